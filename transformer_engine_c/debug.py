"""tec.debug: the saved-tensor aliasing checker (README, "Saved tensors ...").

A userbuffer is shared by every layer that uses its communicator, so a tensor
saved for backward whose memory overlaps one is overwritten by the next
layer's forward. ``check_saved_tensors`` checks every saved tensor's byte
range against every registered buffer range and fails on the first overlap,
naming the tensor, the communicator and what saved it. tests/test_debug_checker.py
exercises it; ``python -m transformer_engine_c.bench_checker`` times it.

Communicator protocol (duck-typed): any object with ``buffer_ranges() ->
[(ptr, nbytes), ...]`` (its own buffer and the peers' buffers mapped into this
process) and a ``name``. Communicators announce themselves with
``register_comm(obj)`` on creation and ``unregister_comm(obj)`` on close; the
registry holds them weakly.
"""
import contextlib
import dataclasses
import linecache
import os
import sys
import threading
import warnings
import weakref

import torch

from . import _C

__all__ = ["check_saved_tensors", "SavedTensorAliasError", "SavedTensorAliasWarning", "Violation",
           "register_comm", "unregister_comm", "live_comms", "saving_layer"]

_find_overlap = _C.find_overlap
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_graph_task_id = torch._C._current_graph_task_id


class SavedTensorAliasError(RuntimeError):
    """A tensor saved for backward overlaps a communicator's buffer.

    ``.violation`` holds the :class:`Violation` that was found."""

    def __init__(self, message, violation=None):
        super().__init__(message)
        self.violation = violation


class SavedTensorAliasWarning(UserWarning):
    """check_saved_tensors(action="warn") found a saved tensor overlapping a buffer."""


@dataclasses.dataclass(frozen=True)
class Violation:
    """One saved tensor that overlaps a communicator buffer."""
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    comm: str                # the communicator's name
    range_index: int         # index into the communicator's buffer_ranges()
    buffer_range: tuple      # (start, end) addresses, end exclusive
    tensor_range: tuple      # the checked (start, end) of the saved tensor
    saver: str               # the layer / Function / op and source line that saved it
    during_backward: bool    # saved while a backward ran (checkpoint recomputation)
    message: str


# ---------------------------------------------------------------- registry

_registry = {}          # id(comm) -> weakref, in registration order
_registry_lock = threading.Lock()
_dead = []              # (key, ref) of collected communicators, pruned under the lock
_generation = 0         # bumped whenever a communicator appears, goes or changes


def _bump():
    global _generation
    _generation += 1


def _prune():
    """Drop collected communicators (call with _registry_lock held)."""
    while _dead:
        key, ref = _dead.pop()
        if _registry.get(key) is ref:
            del _registry[key]


def register_comm(comm):
    """Add ``comm`` to the live communicators that ``check_saved_tensors()``
    checks by default. Userbuffer communicators call this on creation, and
    again whenever their buffer ranges change (re-registering refreshes the
    checkers' range tables). Held weakly: a collected communicator drops out.
    Returns ``comm``."""
    if not callable(getattr(comm, "buffer_ranges", None)):
        raise TypeError(f"register_comm() needs an object with buffer_ranges(), got {type(comm).__name__}")
    key = id(comm)

    def gone(ref, key=key):
        # May run from the garbage collector inside a locked section: only
        # note it (list.append is atomic); the next registry call prunes.
        _dead.append((key, ref))
        _bump()

    try:
        ref = weakref.ref(comm, gone)
    except TypeError:
        raise TypeError(f"register_comm(): {type(comm).__name__} must support weak references "
                        "(a C heap type needs Py_TPFLAGS_MANAGED_WEAKREF or tp_weaklistoffset)") from None
    with _registry_lock:
        _prune()
        _registry[key] = ref
        _bump()
    return comm


def unregister_comm(comm):
    """Remove ``comm`` from the registry (its ``close()`` calls this; harmless
    if it was never registered)."""
    with _registry_lock:
        _prune()
        ref = _registry.get(id(comm))
        if ref is not None and ref() is comm:
            del _registry[id(comm)]
        _bump()


def live_comms():
    """The registered communicators that are still alive, oldest first."""
    with _registry_lock:
        _prune()
        refs = list(_registry.values())
    return [c for c in (r() for r in refs) if c is not None]


def _comm_name(comm):
    name = getattr(comm, "name", None)
    if callable(name):
        name = name()
    return str(name) if name is not None else f"<{type(comm).__name__} at {id(comm):#x}>"


# ---------------------------------------------------------------- attribution

_local = threading.local()      # .stack: modules and layer names being run in this thread
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)


def _stack():
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


@contextlib.contextmanager
def saving_layer(name):
    """Name the layer that saves tensors inside this block in checker messages
    (module calls are named automatically while a checker tracks modules; use
    this for code outside an nn.Module)."""
    s = _stack()
    s.append(str(name))
    try:
        yield
    finally:
        if s and s[-1] == str(name):
            s.pop()


def _module_pre_hook(module, args):
    if not torch.compiler.is_compiling():  # names come from eager calls (a traced call's saves are the graph's)
        _stack().append(module)


def _module_post_hook(module, args, output):
    if torch.compiler.is_compiling():
        return
    s = _stack()
    if s and s[-1] is module:
        s.pop()
    else:       # unbalanced (a hook raised): drop the newest entry for this module
        for i in range(len(s) - 1, -1, -1):
            if s[i] is module:
                del s[i]
                break


def _layer_name(entry, names):
    if isinstance(entry, str):
        return f"layer '{entry}'"
    qual = names.get(id(entry)) if names else None
    if qual is None:
        own = getattr(entry, "name", None) or getattr(entry, "ub_name", None)
        qual = own if isinstance(own, str) else None
    kind = type(entry).__name__
    return f"module '{qual}' ({kind})" if qual else f"module {kind}"


# Which autograd.Function is saving. Its saved tensors are packed inside
# Function.apply after forward returns, and apply has no Python frame from
# PyTorch 2.14 on, so while a checker is active Function.apply is wrapped to
# note the class (a per-thread stack: a Function may apply others in its
# forward). Code that enters its Functions through the C apply directly
# registers itself instead (register_apply_caller).
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_APPLY_CALLERS = {}  # code of a function that calls a Function's C apply -> the local holding the class


def register_apply_caller(code, local="cls"):
    """Name the autograd.Function in the local `local` of frames running
    `code` as the saver (for a caller of a Function's C apply)."""
    _APPLY_CALLERS[code] = local


def _applying():
    s = getattr(_local, "applying", None)
    if s is None:
        s = _local.applying = []
    return s


def _apply_noting(cls, *args, **kwargs):
    s = _applying()
    s.append(cls)
    try:
        return _ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)
    finally:
        s.pop()


def _describe_saver(names):
    """Who is saving right now: the custom autograd.Function (if any), the
    innermost module / named layer, and the innermost source line outside
    torch and this file. Runs only when a violation was found."""
    applying = _applying()
    fn = applying[-1].__name__ if applying else None
    user = None
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if fn is None and f.f_code in _APPLY_CALLERS:
            cls = f.f_locals.get(_APPLY_CALLERS[f.f_code])
            if isinstance(cls, type):
                fn = cls.__name__
        if user is None and not path.startswith(_TORCH_DIR) and os.path.abspath(path) != _THIS_FILE:
            user = f
        f = f.f_back
    who = f"{fn} (autograd.Function)" if fn else "an autograd op"
    stack = _stack()
    if stack:
        who += " in " + _layer_name(stack[-1], names)
    if user is not None:
        src = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
        who += f", at {os.path.basename(user.f_code.co_filename)}:{user.f_lineno} in {user.f_code.co_name}"
        if src:
            who += f": `{src}`"
    return who, user


# ---------------------------------------------------------------- hook composition

# Only the innermost pair of saved-tensor hooks runs. So that hooks pushed
# *inside* an active checker (torch.utils.checkpoint's, save_on_cpu, a user's)
# do not hide saved tensors from it, while any checker is active the push
# function is wrapped: a pair pushed on top of a checker's hooks is composed
# with that checker's check. The wrapper reads the thread's hook stack (which
# autograd copies into its worker threads), so it works in backward too.
_global_lock = threading.Lock()
_active = 0
_tracking = 0
_module_handles = []


def _push_composing(pack_hook, unpack_hook):
    top = _top_hooks(True)
    if top is not None:
        chk = getattr(top[0], "_tec_checker", None)
        if chk is not None and getattr(pack_hook, "_tec_checker", None) is None:
            pack_hook = chk._compose(pack_hook)
    return _push_hooks(pack_hook, unpack_hook)


def _acquire(track_modules):
    global _active, _tracking
    with _global_lock:
        if _active == 0:
            torch._C._autograd._push_saved_tensors_default_hooks = _push_composing
            torch.autograd.Function.apply = classmethod(_apply_noting)
        _active += 1
        if track_modules:
            if _tracking == 0:
                mm = torch.nn.modules.module
                _module_handles[:] = [mm.register_module_forward_pre_hook(_module_pre_hook),
                                      mm.register_module_forward_hook(_module_post_hook, always_call=True)]
            _tracking += 1


def _release(track_modules):
    global _active, _tracking
    with _global_lock:
        _active -= 1
        if _active == 0 and torch._C._autograd._push_saved_tensors_default_hooks is _push_composing:
            torch._C._autograd._push_saved_tensors_default_hooks = _push_hooks
        if _active == 0:
            torch.autograd.Function.apply = _ORIGINAL_APPLY
        if track_modules:
            _tracking -= 1
            if _tracking == 0:
                for h in _module_handles:
                    h.remove()
                _module_handles.clear()


# ---------------------------------------------------------------- the checker

_ACTIONS = ("raise", "warn", "record")
_EXTENTS = ("storage", "view")


def _unpack_unmodified(saved):
    """The checker's own unpack hook: the saved tensor, unless it was modified
    in place since it was saved (autograd's own check, in its words)."""
    t, version = saved
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} "
            "instead (checked by tec.debug.check_saved_tensors, whose saved-tensor hooks turn autograd's own "
            "check off)")
    return t


class SavedTensorChecker:
    """The context manager returned by :func:`check_saved_tensors`.

    Attributes: ``violations`` (list of :class:`Violation`, filled for every
    action) and ``checked`` (how many saved tensors the check saw)."""

    def __init__(self, comms, action, extent, model, track_modules):
        if action not in _ACTIONS:
            raise ValueError(f"check_saved_tensors(): action must be one of {_ACTIONS}, got {action!r}")
        if extent not in _EXTENTS:
            raise ValueError(f"check_saved_tensors(): extent must be one of {_EXTENTS}, got {extent!r}")
        if comms is not None:
            comms = [comms] if hasattr(comms, "buffer_ranges") else list(comms)
            for c in comms:
                if not callable(getattr(c, "buffer_ranges", None)):
                    raise TypeError("check_saved_tensors(): comms must be communicators "
                                    f"(objects with buffer_ranges()), got {type(c).__name__}")
        self.comms, self.action, self.extent = comms, action, extent
        self.track_modules = bool(track_modules)
        self._names = {id(m): n or "<root>" for n, m in model.named_modules()} if model is not None else None
        self._model = model     # keeps the ids in _names valid
        self.violations = []
        self.checked = 0
        self._gen = -1
        self._table = ()
        self._entries = []
        self._entered = False

    # -- range table

    def _refresh(self):
        gen = _generation
        comms = live_comms() if self.comms is None else self.comms
        entries = []
        for c in comms:
            name = _comm_name(c)
            for i, (ptr, nbytes) in enumerate(c.buffer_ranges()):
                ptr, nbytes = int(ptr), int(nbytes)
                if nbytes > 0:
                    entries.append((ptr, ptr + nbytes, name, i))
        entries.sort()
        flat = []
        for s, e, _, _ in entries:      # merge into sorted, disjoint ranges for the C search
            if flat and s <= flat[-1]:
                flat[-1] = max(flat[-1], e)
            else:
                flat += [s, e]
        self._entries, self._table, self._gen = entries, tuple(flat), gen

    def ranges(self):
        """The (start, end, comm_name, range_index) entries checked now."""
        self._refresh()
        return list(self._entries)

    # -- the check (runs for every saved tensor)

    def _check(self, x):
        self.checked += 1
        if self._gen != _generation:
            self._refresh()
        table = self._table
        if not table:
            return
        try:
            if self.extent == "storage":
                st = x.untyped_storage()
                lo = st.data_ptr()
                hi = lo + st.nbytes()
            else:
                lo, hi = _view_extent(x)
        except (RuntimeError, NotImplementedError, TypeError):
            # No storage of its own (a wrapper subclass): check its inner tensors.
            flatten = getattr(x, "__tensor_flatten__", None)
            if flatten is not None:
                for attr in flatten()[0]:
                    inner = getattr(x, attr, None)
                    if isinstance(inner, torch.Tensor):
                        self._check(inner)
            return
        if _find_overlap(lo, hi, table) >= 0:
            self._report(x, lo, hi)

    def _report(self, x, lo, hi):
        hits = [e for e in self._entries if e[0] < hi and lo < e[1]]
        s, e, comm, idx = hits[0]
        saver, frame = _describe_saver(self._names)
        backward = _graph_task_id() != -1
        what = "storage" if self.extent == "storage" else "bytes"
        off = x.data_ptr() - lo
        msg = (f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype} saved for backward overlaps "
               f"buffer range {idx} [{s:#x}, {e:#x}) of communicator '{comm}': its {what} "
               f"[{lo:#x}, {hi:#x}) (data at +{off} bytes). Saved by {saver}"
               + (" during backward (activation-checkpoint recomputation)" if backward else "")
               + (f"; also overlaps {len(hits) - 1} more buffer range(s)" if len(hits) > 1 else "")
               + ". The next layer that uses this communicator overwrites it: save a copy "
                 "(or the local chunk outside the buffer) instead.")
        v = Violation(tuple(x.shape), x.dtype, x.device, comm, idx, (s, e), (lo, hi), saver, backward, msg)
        self.violations.append(v)
        if self.action == "raise":
            raise SavedTensorAliasError(msg, v)
        if self.action == "warn":
            if frame is not None:
                g = frame.f_globals
                warnings.warn_explicit(msg, SavedTensorAliasWarning, frame.f_code.co_filename, frame.f_lineno,
                                       module=g.get("__name__"), registry=g.setdefault("__warningregistry__", {}))
            else:
                warnings.warn(msg, SavedTensorAliasWarning, stacklevel=2)

    def _compose(self, inner_pack):
        """A pack hook that checks, then hands the tensor to `inner_pack`
        (None: keep it, as autograd would)."""
        check = self._check
        if inner_pack is None:
            # Autograd asks pack hooks not to return the tensor itself where
            # that makes a cycle (a saved output holding its own grad_fn). A
            # tensor without grad_fn (a parameter, or one needing no grad)
            # cannot: keep it, identity preserved. Detach the rest. With
            # hooks installed autograd no longer checks that a saved tensor
            # was not modified in place before backward: the version kept
            # here lets the unpack hook check it instead.
            def pack(x):
                check(x)
                return x if x.grad_fn is None else x.detach(), x._version
        else:
            def pack(x):
                check(x)
                return inner_pack(x)

        pack._tec_checker = self
        return pack

    # -- context manager

    def __enter__(self):
        if self._entered:
            raise RuntimeError("check_saved_tensors(): this checker is already active")
        self._refresh()
        below = _top_hooks(True)    # compose with hooks already installed (an outer checker, save_on_cpu...)
        pack = self._compose(below[0] if below is not None else None)
        unpack = below[1] if below is not None else _unpack_unmodified
        _acquire(self.track_modules)
        try:
            _push_hooks(pack, unpack)
        except BaseException:
            _release(self.track_modules)
            raise
        self._entered = True
        return self

    def __exit__(self, *exc):
        self._entered = False
        _pop_hooks()
        _release(self.track_modules)
        return False


def _view_extent(x):
    """[first byte, one past the last byte) that the view `x` can address."""
    if x.numel() == 0:
        return 0, 0
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(x.shape, x.stride()))
    p = x.data_ptr()
    return p, p + span * x.element_size()


def check_saved_tensors(comms=None, action="raise", *, extent="storage", model=None, track_modules=True):
    """Context manager: check every tensor saved for backward inside it
    against the byte ranges of userbuffer communicators.

    comms: a communicator, a list of them, or None for every live registered
        one (``live_comms()``, re-read whenever one is created or closed).
    action: "raise" raises SavedTensorAliasError at the save (inside the op or
        Function that saves); "warn" issues SavedTensorAliasWarning; "record"
        only appends to ``.violations``. Every action records.
    extent: "storage" (default) checks the whole storage behind the tensor,
        [storage.data_ptr(), + storage.nbytes()): a view into a buffer is a
        hazard even where the bytes it shows happen not to be rewritten.
        "view" checks only the bytes the view can address.
    model: an nn.Module whose qualified submodule names go into messages.
    track_modules: name the innermost running nn.Module as the saver (global
        module forward hooks while active).

    Covered: tensors saved by our layers (``prepare_for_saving`` then
    ``ctx.save_for_backward``), by any custom autograd.Function and by any
    op; hooks pushed inside the block (torch.utils.checkpoint's, save_on_cpu)
    are composed with the check rather than hiding it. Run backward inside
    the block as well to check what checkpointing saves on recomputation.
    The block applies to the thread that enters it (and autograd's worker
    threads for a backward started there). ``with ... as chk`` gives the
    :class:`SavedTensorChecker` (``chk.violations``, ``chk.checked``)."""
    return SavedTensorChecker(comms, action, extent, model, track_modules)
