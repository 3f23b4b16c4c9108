"""The mechanisms a DTensor call can meet, one module each, in the order DTensor meets them.

From user code to the result, a call such as ``torch.add(x, y)`` with a DTensor ``x``:

0. **Modes the user opened** see it first: ``gathered_locally()`` (a torch-function mode:
   DTensor arguments gathered, the call runs on plain tensors; :mod:`.gathered`), then
   ``verify()`` and ``scan()`` (dispatch modes; opt-in debugging tools, not part of this
   package's dispatch).
1. **A tracked view** (:mod:`.tracked_views`) takes the call through its own
   ``__torch_dispatch__`` when one of its arguments is one: only views that DTensor had to
   redistribute, so that writes through them reach their source.
2. **A custom handler** (:mod:`.handler`): DTensor's handler table runs the op instead of
   everything below, on every call of that op. torch's own handlers, the patches'
   (:class:`~.handler.Handler`), and, inside ``loss_parallel()``, the handlers that block
   installs (:class:`~.handler.LossParallelHandler` replaces some of them).
3. **Plain tensor arguments** are checked: DTensor asks what a plain tensor beside DTensors
   means; with the fallback on, an ambiguous one raises
   :class:`~dtensor_patches.errors.MixedTensorError` (:mod:`.mixed`; the Python path only).
4. **A cached decision** (torch's propagation cache; C++ from 2.10): the call runs as decided
   before, untouched by the library. This is the hot path, and nothing here adds to it. Which
   arguments key that cache is the op's schema info; :mod:`.cache_key` adds an argument torch
   leaves out (:class:`~.cache_key.CacheKey`).
5. **Miss rules** (:mod:`.miss_rules`), on a cache miss only: the op's own rule, then the rules
   for every op; each keeps torch's decision (then cached) or runs the call itself (never
   cached). Reached through the dispatch hook (:mod:`.hook`). A read of a ``Partial``
   scalar as a number (``loss.item()``) is one such diverted call: :mod:`.scalar_reads`
   reduces it on a side group, checked to be the same read on every rank.
6. **A sharding strategy** (:mod:`.strategy`): torch's propagation picks placements from the
   op's strategy (torch's, or a patch's :class:`~.strategy.Strategy`), redistributes the
   inputs, runs the local op, and caches the decision.
7. **The fallback** (:mod:`.fallback`), where propagation raised: the gather engine
   (:mod:`.gather`) computes the call on gathered inputs, within a memory budget
   (:mod:`.fallback_budget`).

Around DTensor's dispatch, some torch functions are wrapped (:mod:`.wrappers`): the optimizers'
grouping and gradient clipping over mixed kinds (:mod:`.mixed`), the parallel styles'
``distribute_module``, ``loss_parallel()``'s exit.

Every one of these is one registration kind behind one protocol (:mod:`.registration`): the
same all-or-nothing install and exact revert, recorded in one ledger.
"""
