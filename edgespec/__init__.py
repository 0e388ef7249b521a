"""edgespec: batch-1 speculative decoding for robot agents on Jetson Thor and discrete NVIDIA GPUs."""

from importlib.metadata import PackageNotFoundError, version

try:   # the installed distribution's version (pyproject.toml), so the server and doctor report what is installed
    __version__ = version("edgespec")
except PackageNotFoundError:   # a source tree on PYTHONPATH without an install
    __version__ = "0+unknown"
