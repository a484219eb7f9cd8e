"""Op specs of the fused transformer blocks (stem `blocks`): being built (issue 16)."""

SPECS = ()
