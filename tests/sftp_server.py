"""A throwaway SSH server for the SSH remote test, in place of OpenSSH's sshd: asyncssh on
127.0.0.1 with the SFTP subsystem over the real filesystem (what dvc-ssh uses) and public-key
login for one user. tests/servers.py::ssh_server runs it in its own process and stops it with
SIGTERM; it logs every connection, login and channel request to stderr.

    python tests/sftp_server.py --port P --host-key F --authorized-keys F --user U

No shell, no exec, no forwarding: dvc-ssh's push, pull and fetch go through SFTP only (sshfs
runs commands just for cp_file and checksum, which DVC does not call), so a command shows up
in the log as `Command: ...` and is refused."""
import argparse
import asyncio
import logging
import signal

import asyncssh

log = logging.getLogger("sftp_server")


class OneUserServer(asyncssh.SSHServer):
    """Public-key login for one user, with the keys of one authorized_keys file."""

    def __init__(self, user, authorized_keys):
        self.user, self.authorized_keys = user, authorized_keys
        self.conn = None

    def connection_made(self, conn):
        self.conn = conn

    def connection_lost(self, exc):
        # asyncssh logs openings but not endings: say how each connection ended (failed logins too)
        self.conn.logger.info("Connection ended: %s", exc or "closed cleanly")

    def begin_auth(self, username):
        # any other user gets no keys to match, so every login method fails for them
        if username == self.user:
            self.conn.set_authorized_keys(self.authorized_keys)
        else:
            self.conn.logger.warning("No keys for user %r: only %r may log in", username, self.user)
        return True  # authentication is required, for everyone


async def serve(port, host_key, authorized_keys, user):
    """Listen until SIGTERM or SIGINT, then close the listener and its connections."""
    server = await asyncssh.listen(
        "127.0.0.1", port, server_host_keys=[host_key],
        server_factory=lambda: OneUserServer(user, authorized_keys),
        sftp_factory=True,  # asyncssh.SFTPServer: real paths, no chroot, as sshd's internal-sftp
        # refused outright, not merely unconfigured: keys are the only way in
        password_auth=False, kbdint_auth=False, host_based_auth=False, gss_host=None,
        allow_scp=False, allow_pty=False, agent_forwarding=False, x11_forwarding=False)
    log.info("listening on 127.0.0.1:%d for user %s", port, user)
    stopped = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopped.set)
    await stopped.wait()
    log.info("stopping")
    server.close()
    await server.wait_closed()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host-key", required=True)
    parser.add_argument("--authorized-keys", required=True)
    parser.add_argument("--user", required=True)
    args = parser.parse_args(argv)
    # asyncssh logs accepted connections, auth results, channels, subsystems and commands at INFO
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.port, args.host_key, args.authorized_keys, args.user))


if __name__ == "__main__":
    main()
