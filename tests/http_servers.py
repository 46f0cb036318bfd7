"""Test servers on 127.0.0.1: a plain HTTP server and a fake Google Drive behind a TLS proxy.

`serve(app)` runs a threaded server calling app(req, host, url) for every GET, where req is
the BaseHTTPRequestHandler and url the urlsplit of the path. With `tls=` the same server
also accepts CONNECT and speaks TLS inside the tunnel, so a client configured with
HTTPS_PROXY=http://127.0.0.1:<port> and REQUESTS_CA_BUNDLE=<test CA> reaches "drive.google.com"
here, and gdown's real Drive code runs unpatched.
"""
import hashlib
import re
import socket
import ssl
import sys
import threading
import urllib.parse
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import trustme

STALL_LIMIT = 30  # seconds a stalling handler waits at most, even if nobody stops it
DRIVE_NAMES = ("drive.google.com", "docs.google.com", "drive.usercontent.google.com",
               "accounts.google.com")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real servers do
    timeout = 10  # an idle connection must not hold its thread for long

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        host = (self.headers.get("Host") or "").split(":")[0]
        self.server.log.append((host, self.path, dict(self.headers)))
        self.server.app(self, host, urllib.parse.urlsplit(self.path))
        self.wfile.flush()

    def do_CONNECT(self):
        if self.server.tls is None:
            return send(self, 405, b"no proxy here")
        self.send_response(200, "Connection established")
        self.end_headers()
        self.wfile.flush()
        # From here on the client talks TLS to "the host it asked for"; keep serving requests.
        self.connection = self.server.tls.wrap_socket(self.connection, server_side=True)
        self.rfile = self.connection.makefile("rb")
        self.wfile = self.connection.makefile("wb")
        self.close_connection = False


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # hang-ups, rejected certificates: expected
            super().handle_error(request, client_address)

    def get_request(self):
        conn, addr = super().get_request()
        self.connections.append(conn)
        return conn, addr


@contextmanager
def serve(app, tls=None):
    """Run a server for app on 127.0.0.1; yield it (server.url, server.log); stop it after."""
    server = Server(("127.0.0.1", 0), Handler)
    server.app, server.tls, server.log, server.connections = app, tls, [], []
    server.stop = threading.Event()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()  # releases stalling handlers
        server.shutdown()
        for conn in server.connections:  # end keep-alive connections so their threads exit
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()
        thread.join(5)


def refused_url():
    """A URL on 127.0.0.1 where nothing listens (the port was just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/train.csv"


# ---- responses ---------------------------------------------------------------------------

def send(req, status, body=b"", ctype="text/plain", headers=None):
    req.send_response(status)
    req.send_header("Content-Type", ctype)
    req.send_header("Content-Length", str(len(body)))
    for key, value in (headers or {}).items():
        req.send_header(key, value)
    req.end_headers()
    req.wfile.write(body)


def redirect(req, location, status=302):
    send(req, status, b"", "text/html; charset=UTF-8", {"Location": location})


def send_file(req, body, ctype="text/csv", name=None, cut=None, stall=False):
    """Send body, honouring Range/If-Range with an ETag like real file servers.

    cut: send only this many bytes of the announced length, then close (a dropped download).
    stall: send the headers and part of the body, then go silent (a hung server).
    """
    etag = '"%s"' % hashlib.sha256(body).hexdigest()[:16]
    headers = {"ETag": etag, "Accept-Ranges": "bytes"}
    if name:
        headers["Content-Disposition"] = f'attachment; filename="{name}"'
    start = 0
    m = re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range", ""))
    if m and req.headers.get("If-Range", etag) == etag and int(m[1]) < len(body):
        start = int(m[1])
        headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
    req.send_response(206 if start else 200)
    req.send_header("Content-Type", ctype)
    req.send_header("Content-Length", str(len(body) - start))
    for key, value in headers.items():
        req.send_header(key, value)
    req.end_headers()
    part = body[start:]
    if cut is not None or stall:
        req.wfile.write(part[: cut if cut is not None else len(part) // 2])
        req.wfile.flush()
        if stall:
            req.server.stop.wait(STALL_LIMIT)
        req.close_connection = True
        return
    req.wfile.write(part)


def html_page(title, body=""):
    return (f"<!DOCTYPE html><html><head><meta charset=utf-8><title>{title}</title></head>"
            f"<body>{body}</body></html>").encode()


# ---- a fake Google Drive -----------------------------------------------------------------

def make_tls(folder):
    """A test CA (its PEM saved in folder/ca.pem) and a server context for Drive's hosts."""
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*DRIVE_NAMES).configure_cert(ctx)
    bundle = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return ctx, bundle


class FakeDrive:
    """Answers like Drive: uc?id= redirects to drive.usercontent.google.com, large files sit
    behind the virus-scan confirm form, private files send you to a sign-in page, a file over
    quota gets Drive's error page; plus sheet CSV export and embedded folder listings.

    files: {id: (name, bytes, mode)}, mode in direct, confirm, quota, private, cut_once
    folders: {id: (title, [(child id, child name, "file" | "folder")]) or None (deleted)}
    sheets: {id: bytes or None (a private sheet)}
    """

    def __init__(self, files=(), folders=(), sheets=()):
        self.files, self.folders, self.sheets = dict(files), dict(folders), dict(sheets)
        self.served = {}  # id -> number of body requests, for cut_once

    def __call__(self, req, host, url):
        q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        if host == "drive.google.com" and url.path in ("/uc", "/open"):
            if q.get("id") in self.sheets:  # a Google-native file: uc fails, open shows the editor
                return (send(req, 500, b"", "text/html") if url.path == "/uc" else redirect(
                    req, f"https://docs.google.com/spreadsheets/d/{q['id']}/edit?usp=drive_web"))
            return self.uc(req, q.get("id"))
        if host == "docs.google.com" and re.fullmatch(r"/spreadsheets/d/[-\w]+/edit", url.path):
            return send(req, 200, html_page("Sheet - Google Sheets"), "text/html; charset=utf-8")
        if host == "drive.usercontent.google.com" and url.path == "/download":
            return self.usercontent(req, q)
        if host == "drive.google.com" and url.path == "/embeddedfolderview":
            return self.folder(req, q.get("id"))
        if host == "docs.google.com" and (m := re.fullmatch(r"/spreadsheets/d/([-\w]+)/export", url.path)):
            return self.sheet(req, m[1], q)
        if host == "accounts.google.com":
            return send(req, 200, html_page("Sign in - Google Accounts", "<h1>Sign in</h1>"),
                        "text/html; charset=utf-8")
        send(req, 404, html_page("Error 404 (Not Found)!!1"), "text/html; charset=UTF-8")

    def uc(self, req, file_id):
        name, _, mode = self.files.get(file_id, (None, None, "deleted"))
        if mode == "deleted":
            return send(req, 404, html_page("Google Drive - Page Not Found"), "text/html; charset=utf-8")
        if mode == "private":
            return redirect(req, "https://accounts.google.com/ServiceLogin?service=wise&continue="
                            + urllib.parse.quote(f"https://drive.google.com/uc?id={file_id}"))
        if mode == "quota":
            caption = ("Too many users have viewed or downloaded this file recently. Please try "
                       "accessing the file again later. If the file you are trying to access is "
                       "particularly large or is shared with many people, it may take up to 24 "
                       "hours to be able to view or download the file.")
            page = html_page("Google Drive - Quota exceeded",
                             f'<p class="uc-error-caption">Sorry, you can\'t view or download this '
                             f'file at this time.</p>\n<p class="uc-error-subcaption">{caption}</p>')
            return send(req, 200, page, "text/html; charset=utf-8")
        redirect(req, f"https://drive.usercontent.google.com/download?id={file_id}&export=download", 303)

    def usercontent(self, req, q):
        name, body, mode = self.files[q["id"]]
        if mode == "confirm" and q.get("confirm") != "t":
            form = ('<form id="download-form" action="https://drive.usercontent.google.com/download" '
                    'method="get"><input type="submit" id="uc-download-link" value="Download anyway"/>'
                    f'<input type="hidden" name="id" value="{q["id"]}"><input type="hidden" '
                    'name="export" value="download"><input type="hidden" name="confirm" value="t">'
                    '<input type="hidden" name="uuid" value="0a1b2c3d-test"></form>')
            page = html_page("Google Drive - Virus scan warning",
                             f"<p>Google Drive can't scan {name} for viruses.</p>\n{form}")
            return send(req, 200, page, "text/html; charset=utf-8")
        self.served[q["id"]] = self.served.get(q["id"], 0) + 1
        first = self.served[q["id"]] == 1
        cut = len(body) // 2 if mode == "cut_once" and first else None
        send_file(req, body, "application/octet-stream", name=name, cut=cut)

    def folder(self, req, folder_id):
        if folder_id not in self.folders:  # private: Drive shows a sign-in page
            return redirect(req, "https://accounts.google.com/ServiceLogin?service=wise")
        if self.folders[folder_id] is None:  # gone
            return send(req, 404, html_page("Google Drive - Page Not Found"), "text/html; charset=utf-8")
        title, children = self.folders[folder_id]
        links = "".join(
            f'<div class="flip-entry"><a href="https://drive.google.com/'
            f'{"drive/folders/" if kind == "folder" else "file/d/"}{cid}'
            f'{"" if kind == "folder" else "/view?usp=drive_web"}" target="_blank">'
            f'<div class="flip-entry-title">{name}</div></a></div>'
            for cid, name, kind in children)
        send(req, 200, html_page(title, links), "text/html; charset=utf-8")

    def sheet(self, req, sheet_id, q):
        body = self.sheets.get(sheet_id)
        if body is None or q.get("format") != "csv":
            return redirect(req, "https://accounts.google.com/ServiceLogin?service=wise")
        send_file(req, body, "text/csv", name="Sheet1.csv")
