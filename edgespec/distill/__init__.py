"""``edgespec distill``: train and adapt DFlash drafters on a target's own outputs (see docs/drafters.md)."""
