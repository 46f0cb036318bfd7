"""`python -m tune.guard CMD...`: runs one trial's command (`dvc exp run ...`) and stops it when the
tuner that started it is gone.

The tuner starts the guard in a session of its own, with a pipe on its standard input. While the tuner
lives, the pipe stays open. When the tuner ends in any way, SIGKILL included, the pipe closes, and the
guard sends SIGINT to its session: the train stage saves a checkpoint and stops (StopOnSignal) and DVC
cleans up its temporary copy. Without it, a killed tuner would leave its trial training on, holding a
GPU and DVC's locks, while the study retries that trial elsewhere.
"""
import os
import signal
import subprocess
import sys
import threading


def main():
    # the guard outlives the signals it sends to its own session; the command gets the default handlers
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *args: None)
    command = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)

    def stop_when_orphaned():
        while os.read(0, 4096):  # empty at end of file: the tuner closed the pipe, or died
            pass  # (os.read, not sys.stdin: a daemon thread holding stdin's lock would crash the exit)
        if command.poll() is None:
            os.killpg(0, signal.SIGINT)

    threading.Thread(target=stop_when_orphaned, daemon=True).start()
    sys.exit(command.wait())


if __name__ == "__main__":
    main()
