"""Repository tooling, not shipped in the wheel: the op sweep (``python -m tools.sweep``), the
compatibility matrix (``python -m tools.matrix``) and the generated patch table
(``python -m tools.patch_table``). Run from the repository root."""
