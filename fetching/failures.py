"""Saying in one line why a fetch failed and what to do about it.

The gist of a download exception (gdown's or requests'), the message of an HTML page where
data was expected, and advice from Drive's own words; shorten keeps every error one line.
"""
import html
import re

import requests
from gdown.exceptions import DownloadError, FileURLRetrievalError

from pipeline.command import redact


def page_text(page):
    """The message of an HTML page: Drive's error caption if there is one, else its title."""
    m = (re.search(r'class="uc-error-subcaption"[^>]*>(.*?)</p>', page, re.S | re.I)
         or re.search(r"<title[^>]*>(.*?)</title>", page, re.S | re.I))
    text = re.sub(r"<[^>]+>", " ", m[1]) if m else page[:200]
    return first_sentence(html.unescape(text))


def advice(message):
    """What to do about a refusal, from Drive's (or a page's) own words."""
    m = message.lower()
    if "too many users" in m or "quota" in m:
        return ("the file's download quota is used up: wait (up to 24 h), or copy it to your "
                "own Drive or another host and point fetch.source at the copy")
    if any(w in m for w in ("sign in", "sign-in", "permission", "public link", "access")):
        return ("the file is not shared publicly, or no longer exists: share it as "
                "'Anyone with the link' and check the link")
    if any(w in m for w in ("not found", "404", "does not exist", "deleted")):
        return "the file does not exist: check the id or link"
    return ("use a direct download link (open the link in a browser: it should download, "
            "not show a page) or a mirror")


def first_sentence(text):
    """The first sentence of a message, short enough to quote in a one-line error."""
    text = " ".join(str(text).split())
    m = re.match(r".+?[.!?](?=\s|$)", text)
    return shorten(m[0] if m else text, 120)


def shorten(text, limit=200):
    """One line of at most `limit` characters, so every error stays a one-line message."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def explain_failure(what, exc, net):
    """One line saying why a download of `what` failed and what to do."""
    attempts = f"{net.retries + 1} attempt{'s' if net.retries else ''}"
    cause = exc
    if isinstance(exc, DownloadError) and str(exc).startswith("Download failed after"):
        cause = exc.__cause__ or exc  # gdown wraps the last network error after its retries
    text = str(cause)
    if isinstance(cause, FileURLRetrievalError):
        # gdown indents Google's own words between "Failed to retrieve file url:" and a blank line
        m = re.search(r"file url:\s*\n\n(.*?)\n\n", text, re.S)
        said = first_sentence(m[1] if m else text)
        return f"{what}: Drive says {said!r}: {advice(said)}"
    if isinstance(cause, requests.HTTPError) and cause.response is not None:
        r = cause.response
        hint = ("the server failed; try again later, or use a mirror" if r.status_code >= 500
                else "the server refused access; make the file public" if r.status_code in (401, 403)
                else "check the URL")
        return f"{what}: the server answered {r.status_code} {r.reason} ({attempts}); {hint}"
    if "Failed to retrieve folder contents" in text:
        code = re.search(r"status code (\d+)", text)
        return (f"{what}: Drive would not list the folder (status {code[1] if code else '?'}): "
                "share it as 'Anyone with the link' and check the link")
    if isinstance(cause, requests.exceptions.SSLError):
        return (f"{what}: the TLS certificate check failed ({network_reason(text)}); check the "
                "URL, or set REQUESTS_CA_BUNDLE to your network's CA certificates")
    if isinstance(cause, requests.exceptions.ProxyError):
        return f"{what}: the proxy failed ({network_reason(text)}); check HTTPS_PROXY"
    if text.startswith("Download is incomplete"):
        m = re.search(r"server announced (\d+) bytes", text)
        size = f"; the server announced {m[1]} bytes" if m else ""
        return (f"{what}: the download was cut short ({attempts}{size}); "
                "run fetch again, or raise fetch.retries")
    if isinstance(cause, requests.Timeout) or "timed out" in text:
        return (f"{what}: no data for {net.timeout:g} s ({attempts}); "
                "check your network, or raise fetch.timeout")
    if isinstance(cause, requests.ConnectionError):
        return (f"{what}: could not connect ({network_reason(text)}, {attempts}); "
                "check the URL and your network")
    return f"{what}: download failed: {shorten(redact(text))}"


def network_reason(text):
    """The gist of a requests/urllib3 error, whose text nests several exceptions' reprs."""
    for needle, reason in (("refused", "connection refused"),
                           ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed"),
                           ("Failed to resolve", "host name not found"),
                           ("Name or service not known", "host name not found"),
                           ("Unable to connect to proxy", "cannot reach the proxy"),
                           ("unreachable", "network unreachable"),
                           ("reset by peer", "connection reset")):
        if needle in text:
            return reason
    return shorten(text, 120)
