"""The one boundary with torch's private APIs.

Only the modules of this subpackage touch private torch names: modules whose path has a part
that starts with ``_`` (``torch.distributed.tensor._op_schema``, ``torch.utils._pytree``), and
private attributes (``DTensor._spec``, ``OpOverload._schema``, ``torch._C``). A lint rule (ruff
``SLF001``) and a test (``tests/test_boundary.py``) fail CI when any other module of the
package uses one. When a torch release moves an internal, the accessor here raises
:class:`~dtensor_patches.errors.PatchError` naming it (``PatchError.internal``), so a patch
fails to apply, loudly and with torch untouched, instead of misbehaving later.

By what they touch:

- :mod:`.access`: the one way to reach an internal (import it or raise ``PatchError``);
- :mod:`.versions`: the running release, and the facts that depend on it;
- :mod:`.dtensors`: DTensor objects and their specs (local tensors, specs, relabels, shards);
- :mod:`.schemas`: op overloads and their schemas (written arguments, views, ``out=``
  variants, argument binding) and torch's pytree;
- :mod:`.tables`: DTensor's own tables (strategies, handlers) and their caches;
- :mod:`.attributes`: the module attributes and class methods the library may replace, as
  tables the ledger can layer and restore;
- :mod:`.dispatch_hook`: where a sharding-propagation cache miss can be seen, for each of the
  two dispatch designs (2.9: Python; 2.10+: C++ with a Python slow path);
- :mod:`.modes`: dispatch and function modes, autograd nodes, alias correction.

How the internals moved between releases: ``docs/design.md`` §2.
"""
