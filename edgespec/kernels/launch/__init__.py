"""Launch helpers shared by the Triton kernels and the benches: programmatic dependent launch (:mod:`.triton_pdl`),
the ``%smid`` read-back (:mod:`.triton_smid`) and reading a compiled kernel's SASS (:mod:`.sass`)."""
