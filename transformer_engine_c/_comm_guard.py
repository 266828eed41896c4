"""What keeps CommOverlap's failures clear, apart from the class:
the per-communicator lock decorator, argument bounds and shape checks, the
marker a rank sends when it could not create its communicators, and the
release of communicators before the interpreter finalizes. Used by
userbuffers.py; tests/test_reliability*.py exercise it."""
import functools
import gc
import operator


def _serialised(method):
    """Run the method under the communicator's lock: one thread at a time
    issues work on a communicator (README, "Failure behaviour")."""
    @functools.wraps(method)
    def locked(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)
    return locked


class _CreateFailed:
    """What a rank that could not create its communicators sends its peers
    in the handle exchange (a plain object: all_gather_object pickles it)."""

    def __init__(self, kind, message):
        self.kind, self.message = kind, message


# Bounds of CommOverlap's arguments: the engine's region (data, staging,
# flags) must be addressable with room to spare; timeouts are finite
# (TEC_COMM_TIMEOUT_MAX of tec.h).
_BUFFER_BYTES_MAX = 2 ** 60
_TIMEOUT_MAX = 1e6


def _int_shape(shape, what):
    """A shape as a tuple of Python ints: each entry an integer (a float or
    a bool is refused, never truncated)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {type(shape).__name__}") from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise TypeError(f"{what} must be a sequence of ints, got {shape!r}")
        out.append(operator.index(d))
    return tuple(out)


def release_at_exit(registry):
    """atexit: release what this package holds while the interpreter is
    still whole. Communicators (ours, in the registry and in reference
    cycles through layers) keep their tp_group alive; a process group whose
    last reference goes in the interpreter's final collection joins gloo's
    worker threads after Python has started finalizing, and a worker that
    then drops a finished collective (whose thread-local state holds Python
    objects, e.g. saved-tensor hooks) must take the GIL and exits the thread
    from inside a destructor: "terminate called without an active
    exception". Closing locally (no collective: the peers may be gone) and
    collecting here lets the group go while its threads can still finish.
    `registry`: userbuffers' {name: CommOverlap} (its owner passes it)."""
    from .distributed import close_engine_collectives

    try:  # their watchdogs stop before CUDA goes; they also hold process groups
        close_engine_collectives(abort=True)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass

    for c in list(registry.values()):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    registry.clear()
    gc.collect()
