"""The served model id: ``--served-model-name`` when set, else the name of the folder or GGUF file the user named
(never the hashed cache folder a GGUF converts into); ``GET /v1/models`` reports it and where it comes from, and a
request for another model gets a 404 that names the served id and how to set it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from serving_helpers import ServerThread, write_tiny_chat_model

from edgespec.config import Settings
from edgespec.engine import Engine
from edgespec.model_id import served_model_id
from edgespec.plan import build_plan
from edgespec.serving import create_app


def test_the_default_id_is_the_name_the_user_gave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert served_model_id("/models/Qwen3-4B") == served_model_id("/models/Qwen3-4B/") == "Qwen3-4B"
    assert served_model_id("~/weights/qwen3-4b-q4_k_m.gguf") == "qwen3-4b-q4_k_m"
    assert served_model_id("demo") == "smollm2-135m-instruct"
    assert served_model_id("/models/Qwen3-4B", "robot-agent") == "robot-agent"
    (tmp_path / "Robot-7B").mkdir()
    (tmp_path / "current").symlink_to(tmp_path / "Robot-7B")
    monkeypatch.chdir(tmp_path / "Robot-7B")
    assert served_model_id(".") == "Robot-7B"
    assert served_model_id(str(tmp_path / "current")) == "current"      # the link's own name, stable across updates


def test_a_gguf_is_served_under_its_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf_files import write_tiny_gguf

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny-robot-Q4_1.gguf")
    engine = Engine.load(build_plan(Settings(model=str(gguf), max_seq_len=128, drafter="none", device="cpu")))
    assert engine.model_dir.name != "tiny-robot-Q4_1"         # the converted folder's name carries a hash
    assert engine.model_id == "tiny-robot-Q4_1"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model-id") / "robot-planner")


@pytest.mark.parametrize("served_name", [None, "robot-agent"])
def test_models_endpoint_and_404_say_the_served_id(tiny_dir: Path, served_name: str | None) -> None:
    settings = Settings(model=str(tiny_dir), max_seq_len=256, drafter="none", served_model_name=served_name,
                        max_tokens=2)
    served = served_name or "robot-planner"
    plan = build_plan(settings)
    with ServerThread(create_app(Engine.load(plan), plan)) as s:
        cards = httpx.get(s.url + "/v1/models").json()["data"]
        assert [c["id"] for c in cards] == [served]
        if served_name:
            assert cards[0]["id_set"] == "served_model_name"
        else:
            assert cards[0]["id_set"].startswith("default: the name of the model folder")
            assert "--served-model-name" in cards[0]["id_set"]
        assert httpx.get(s.url + f"/v1/models/{served}").json()["id"] == served
        ok = httpx.post(s.url + "/v1/chat/completions",
                        json={"model": served, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and ok.json()["model"] == served
        wrong = httpx.post(s.url + "/v1/chat/completions",
                           json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
        error = wrong.json()["error"]
        assert wrong.status_code == 404 and error["code"] == "model_not_found"
        assert f"this server serves `{served}`" in error["message"] and "--served-model-name" in error["message"]
