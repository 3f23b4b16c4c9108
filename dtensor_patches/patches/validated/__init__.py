"""Cells torch's own strategies get wrong, measured by the strategy validator and routed by
data (``data/wrong_cells.json``): one patch per op family."""
