"""Patches for in-place writes: Partial targets, writes through redistributed views, in-place scans."""
