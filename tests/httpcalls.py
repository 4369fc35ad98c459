"""One HTTP request as the tests send it to a tracking server: a Host header, basic auth, a JSON body."""
import base64
import json
import urllib.error
import urllib.request


def request(url: str, host: str | None = None, user: str | None = None, password: str | None = None,
            method: str = "GET", body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """(status, body) of one request (this Host header if given, basic auth when `user` is, a JSON
    `body` if any); an HTTP error is a status, not an exception."""
    headers = {"Host": host} if host else {}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
