"""How a script meets its user: argument parsers, and bad input as one line on stderr, never a
traceback.

    if __name__ == "__main__":
        cli.run(main)              # one process: `error: ...` and exit 1 on bad input
        cli.run_distributed(main)  # every rank of a torchrun / deepspeed / mpirun job
"""
import argparse
import errno
import os
import signal
import sys
import time
from collections.abc import Callable

_at_end: list[Callable[[], None]] = []  # what run() does when main() ends, however it ends
# progress bars written where stderr is no terminal (a log) start this many seconds in: an error
# before then stays the one line on stderr
PROGRESS_DELAY = 2.0


class CLIError(Exception):
    """A problem with the user's input or files, printed as `error: <message>`, exit status 1."""


def at_end(action: Callable[[], None]) -> None:
    """Have run() call action when the script's main() ends (e.g. to let go of a folder lock)."""
    if action not in _at_end:
        _at_end.append(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line too: `error: ... (see --help)`, exit 2;
    nanoGPT's spellings are read too: --max_iters (which HF's and torchrun's parsers also take) is
    --max-iters, and --compile=False is --no-compile."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after "--", every word is a value
        return super().parse_known_args([self.dashed(a) for a in args[:end]] + args[end:],
                                         namespace)

    def dashed(self, arg: str) -> str:
        """arg with its flag's underscores as dashes, where only the dashed flag is an option here
        (DeepSpeed's --deepspeed_config stays as it is), and a switch's =True or =False as the
        switch or its --no- form."""
        flag, equals, value = arg.partition("=")
        known = self._option_string_actions
        if not flag.startswith("--"):
            return arg
        if flag not in known and flag.replace("_", "-") in known:
            flag = flag.replace("_", "-")
        if (isinstance(known.get(flag), argparse.BooleanOptionalAction)
                and value in ("True", "False")):
            return flag if value == "True" else "--no-" + flag[2:]
        return flag + equals + value


def argument_parser(description: str | None) -> ArgumentParser:
    """A parser that keeps the description's layout and takes no abbreviations: with prefix
    matching, Megatron's --save would be read as a prefix of --save-interval."""
    return ArgumentParser(description=description,
                          formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)


def error_message(error: Exception) -> str:
    """The one line a user sees for an error: its text, or for an operating-system error the file
    and the cause in words (`data/x: no such file or directory`), never `[Errno N]`."""
    if isinstance(error, OSError) and error.strerror:
        cause = error.strerror.lower()
        if error.errno == errno.ENOSPC:
            cause = "no space left on device; free some space and run again"
        return f"{error.filename}: {cause}" if error.filename else cause
    return " ".join(str(error).split()) or type(error).__name__


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA, or a RuntimeError that says so: MPS, other backends), without
    importing torch (data preparation never does), or the host's: a MemoryError (numpy's, for a
    batch of absurd size) or torch's CPU allocator failing."""
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError" or (
        isinstance(error, RuntimeError) and ("out of memory" in str(error).lower()
                                             or host_out_of_memory(error)))


def host_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or CPU_ALLOCATOR_FAILED in str(error)


def out_of_memory(error: BaseException) -> str:
    """OUT_OF_MEMORY, of the GPU's memory or the host's."""
    where = "" if host_out_of_memory(error) else "GPU "
    return OUT_OF_MEMORY.format(where, first_line(error))


CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"  # torch's words
PEER_REPORTED = "cli_error/peer"  # a rank other than 0 said why it stopped
ERROR_KEY = "cli_error/0"  # rank 0's error, for the other ranks to compare with theirs
ERROR_READERS = "cli_error/readers"  # how many other ranks have read it
OUT_OF_MEMORY = ("out of {}memory ({}): the model, batch or context did not fit; lower "
                 "--batch-size (and raise --grad-accum to keep the batch), --block-size or the "
                 "model's size, use --dtype bfloat16, or train with ZeRO-3 and CPU offload "
                 "(train_ds.py; its --estimate-memory says what fits); checkpoints already written "
                 "are as they were")


def first_line(error: BaseException) -> str:
    """The first line of an error's text (a library's may run on for pages), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def run(main: Callable[[], None]) -> None:
    """Run a script's main(); user errors (CLIError, ValueError, OSError) print one line and exit 1.
    SIGTERM interrupts like Ctrl-C, so the script's cleanup (temporary files) runs either way."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        refuse_launcher()
        main()
    except (CLIError, ValueError, OSError) as e:
        print(f"error: {error_message(e)}", file=sys.stderr)
        sys.exit(1)
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        print(f"error: {out_of_memory(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
        while _at_end:
            _at_end.pop()()


def refuse_launcher() -> None:
    """A one-process script started by torchrun or the deepspeed launcher: every copy would do the
    same work and race for the same outputs (only rank 0 says so)."""
    size = os.environ.get("WORLD_SIZE", "1")
    if not size.isdigit() or int(size) < 2:
        return
    script = os.path.basename(sys.argv[0])
    more = ("; several processes train with train_ddp.py (torchrun) or train_ds.py (deepspeed)"
            if script == "train.py" else "")
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {script} runs in one process, but a launcher started {size} "
              f"(WORLD_SIZE={size}): run it with python{more}", file=sys.stderr, flush=True)
    else:  # quiet: the launcher stops this copy once rank 0 has said why and exited
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(3)
    sys.exit(1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def group_store():
    """The process group's key-value store, or None outside one."""
    import torch.distributed as dist  # 1.5 s of torch: tokenizer.py never imports it
    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def report_distributed_error(message: str) -> None:
    """In a process group, rank 0 prints the error; another rank prints its own only when rank 0 did
    not report the same one (e.g. data missing on one node only) in the group's key-value store."""
    rank = os.environ.get("RANK", "0")  # as set, even when it is no number
    store = group_store()
    if rank == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
        if store is not None:
            store.set(ERROR_KEY, message)
            wait_for_readers(store)
        return
    # failed before the process group existed: rank 0 most likely failed the same way, and the
    # launcher stops this rank while rank 0 prints it; a rank still here failed alone
    if store is None:
        time.sleep(3)
        print_peer_error(message)
        return
    try:  # polled: a store.wait that times out logs two lines of C++ warnings
        deadline = time.monotonic() + 6  # rank 0 may reach the same check seconds later
        while not store.check([ERROR_KEY]) and time.monotonic() < deadline:
            time.sleep(0.05)
        said = store.check([ERROR_KEY]) and store.get(ERROR_KEY).decode()
        if said:
            store.add(ERROR_READERS, 1)
    except Exception:  # the store (rank 0) is gone: touching it again would log C++ warnings
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
        return
    if said != message:
        print_peer_error(message)


def wait_for_readers(store) -> None:
    """Rank 0's store serves the others: it stays up (5 s at most) until every rank that failed too
    has read rank 0's error, so none of them finds the store gone and logs C++ warnings."""
    import torch.distributed as dist  # see group_store
    deadline = time.monotonic() + 5
    try:
        while (store.add(ERROR_READERS, 0) < dist.get_world_size() - 1
               and time.monotonic() < deadline):
            time.sleep(0.05)
    except Exception:  # the store failed: nobody is left to wait for
        pass


def print_peer_error(message: str) -> None:
    """A rank other than 0 says why it stopped, and leaves word of it (PEER_REPORTED) for rank 0,
    which then adds no line of its own."""
    rank = os.environ.get("RANK", "0")
    try:
        group_store().set(PEER_REPORTED, rank)
    except Exception:  # no group, or its store is gone
        pass
    print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)


def peer_reported() -> bool:
    """Whether another rank said why it stopped (report_distributed_error)."""
    try:
        return group_store().check([PEER_REPORTED])
    except Exception:  # no group, or its store is gone too
        return False


def stop_torchrun_restarts() -> None:
    """torchrun restarts failed workers up to --max-restarts, but a bad input fails (and prints) the
    same way each time: after reporting it, local rank 0 asks its torchrun agent to stop the job."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    if os.environ.get("LOCAL_RANK") == "0":
        os.kill(os.getppid(), signal.SIGTERM)
    else:  # exiting first would make the agent restart the job before local rank 0 stops it
        time.sleep(10)


def run_distributed(main: Callable[[], None]) -> None:
    """run()'s contract under a launcher (torchrun, deepspeed, mpirun): a user error or a lost peer
    is one line from rank 0; every rank destroys the process group before its non-zero exit."""
    import torch.distributed as dist  # see group_store
    status = 0
    try:
        main()
    except (CLIError, ValueError, OSError) as e:
        report_distributed_error(error_message(e))
        stop_torchrun_restarts()
        status = 1
    except (MemoryError, RuntimeError) as e:
        # a peer died or hung: the launcher stops (or restarts) the job anyway
        if is_out_of_memory(e):  # on any rank: each says so, with its rank
            print_peer_error(out_of_memory(e))
            stop_torchrun_restarts()
        elif not isinstance(e, dist.DistError) and "gloo" not in str(e):
            raise
        elif os.environ.get("RANK", "0") == "0" and not peer_reported():  # (else it said why)
            print(f"error: lost contact with another process ({first_line(e)})", file=sys.stderr,
                  flush=True)
        status = 1
    except KeyboardInterrupt:  # a second SIGINT/SIGTERM while saving
        if os.environ.get("RANK", "0") == "0":
            print("interrupted", file=sys.stderr)
        status = 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without interpreter finalization. DeepSpeed keeps references to its gloo groups, whose
    # C++ worker threads are then torn down during finalization and can abort a run that has
    # finished and saved ("terminate called without an active exception", SIGABRT;
    # pytorch/pytorch#190489). Everything is written and flushed by now. mpirun counts a process
    # that exits without MPI_Finalize as failed (mpi4py finalizes at interpreter exit, which
    # os._exit skips).
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
