"""Exports and downloads: save_weights_external, external_weights_urls, and the signed file route.

The SDK CLI and tinker-cookbook download an export by asking for one URL per file and fetching each
with plain urllib and no API key, so the URL itself is the credential. tinkerd serves the files
itself: `/files/external_weights/<run_id>/<name>/<file>?expires=<unix s>&sig=<hex>`, where `sig` is
HMAC-SHA256 over (run_id, name, file, expires) under a secret kept in the data directory (created
on first use, mode 0600; deleting it revokes every URL handed out). A URL is good until `expires`
(DOWNLOAD_URL_TTL_S after signing; clients re-sign when under 5 minutes remain) and only while the
checkpoint exists: deleting or expiring the export makes its URLs 404.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from tinker import types as t

from tinkerd.api import limits
from tinkerd.api.deps import AppState, Prepared, account, authenticate, name_taken, parse, read_body, state, submit
from tinkerd.artifacts import CHUNK
from tinkerd.control.control import Work
from tinkerd.control.oplog import OpRecord, OpType, Payer, RegisterCheckpoint
from tinkerd.control.ids import TinkerPath, check_name, check_ttl, iso
from tinkerd.control.records import Checkpoint
from tinkerd.errors import Forbidden, NotFoundError, UserError
from tinkerd.types import ExportWeightsOp, base_model_of

authed = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])
# No API key on downloads: the signature is the credential.
router = APIRouter()

DOWNLOAD_URL_TTL_S = 3600
KEY_FILE = "url_signing.key"


class UrlSigner:
    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> "UrlSigner":
        path = Path(data_dir) / KEY_FILE
        if not path.exists():
            # Written aside and linked into place: two processes starting at once agree on one key,
            # and a crash never leaves a truncated key.
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{KEY_FILE}.")
            try:
                os.write(fd, secrets.token_bytes(32))
                os.fsync(fd)
                os.close(fd)
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        return cls(path.read_bytes())

    def signature(self, run_id: str, name: str, file_name: str, expires: int) -> str:
        message = "\n".join((run_id, name, file_name, str(expires))).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def verify(self, run_id: str, name: str, file_name: str, expires: str | None, sig: str | None) -> None:
        if not expires or not sig:
            raise Forbidden("this download URL is not signed; get one from external_weights_urls")
        if not expires.isdigit() or not hmac.compare_digest(self.signature(run_id, name, file_name, int(expires)), sig):
            raise Forbidden("invalid download URL signature (altered, or signed with another server key)")
        if int(expires) <= time.time():
            when = datetime.fromtimestamp(int(expires), timezone.utc).isoformat()
            raise Forbidden(f"this download URL expired at {when}; request new URLs with external_weights_urls")


def _signer(request: Request) -> UrlSigner:
    signer = getattr(request.app.state, "url_signer", None)
    if signer is None:
        signer = request.app.state.url_signer = UrlSigner.for_data_dir(state(request).config.data_dir)
    return signer


def prepare_save_weights_external(st: AppState, body: bytes, account_id: str | None = None) -> Prepared:
    """From the body alone, so recovery re-queues an accepted export after a server restart."""
    req = parse(t.SaveWeightsExternalRequest, body)
    run = st.runs.training_runs.owned_run(req.model_id, account_id)
    limits.seq_id(req.seq_id)
    path = TinkerPath(req.model_id, "external_weights", check_name(req.path, "path"))
    ttl = check_ttl(req.ttl_seconds)
    # The request has no overwrite flag; like save_weights' default, an existing name is refused.
    # (Re-queued after a restart, an export that was written but not registered is written again.)
    if name_taken(st, path, "SaveWeightsExternal", req.model_id, req.seq_id, account_id):
        raise UserError(f"external weights {path} already exist; delete them or choose another name")
    op = ExportWeightsOp(req.model_id, st.runs.checkpoints.checkpoint_key(path), req.age_encryption_recipients,
                         base_model=base_model_of(run.base_model))
    owner = account_id if account_id is not None else st.runs.sessions.account_of(run.session_id)
    # Control registers the export when it is written (control/bookkeeping.py; size_bytes joins the reply).
    record = OpRecord(OpType.SAVE_WEIGHTS_EXTERNAL, op, Payer(owner, run.session_id, run.base_model),
                      effect=RegisterCheckpoint(str(path), ttl, None), reply={"path": str(path)})
    return Prepared("SaveWeightsExternal", req.model_id, req.seq_id, Work.of(record))


PREPARERS = {"SaveWeightsExternal": prepare_save_weights_external}


@authed.post("/save_weights_external")
def save_weights_external(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
    st = state(request)
    account_id = account(request)
    return submit(st, prepare_save_weights_external(st, body, account_id), body, account_id)


@authed.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls")
def external_weights_urls(run_id: str, name: str, request: Request) -> dict:
    st = state(request)
    row = st.runs.checkpoints.owned_checkpoint(TinkerPath(run_id, "external_weights", check_name(name)), account(request))
    urls, expires = download_urls(request, row)
    return {"urls": urls, "expires": iso(datetime.fromtimestamp(expires, timezone.utc).replace(tzinfo=None))}


def download_urls(request: Request, row: Checkpoint) -> tuple[dict[str, str], int]:
    """Signed download URLs of an (ownership-checked) external_weights checkpoint's files, and when
    they expire (unix time); also the console's download links."""
    run_id, name = row.model_id, row.name
    signer = _signer(request)
    expires = int(time.time()) + DOWNLOAD_URL_TTL_S
    # request.base_url carries the scheme, host and port the client used, so the URLs work from
    # wherever the client reached the API (localhost, a LAN address, a proxy's root path).
    base = str(request.base_url).rstrip("/")
    urls = {}
    runs = state(request).runs
    for f in runs.artifacts.names(runs.checkpoints.key_of(row)):
        sig = signer.signature(run_id, name, f, expires)
        urls[f] = f"{base}/files/external_weights/{quote(run_id, safe=':')}/{name}/{f}?expires={expires}&sig={sig}"
    return urls, expires


@router.api_route("/files/external_weights/{run_id}/{name}/{file_name}", methods=["GET", "HEAD"])
def download_file(run_id: str, name: str, file_name: str, request: Request,
                        expires: str | None = None, sig: str | None = None) -> Response:
    _signer(request).verify(run_id, name, file_name, expires, sig)
    runs = state(request).runs
    row = runs.checkpoints.checkpoint(TinkerPath(run_id, "external_weights", check_name(name)))
    # The signature already pins the file name; this also keeps a leaked key from reading outside
    # the export.
    key, file_name = runs.checkpoints.key_of(row), check_name(file_name)
    size = runs.artifacts.files(key).get(file_name)
    if size is None:
        raise NotFoundError(f"{file_name!r} is not a file of {row.tinker_path}")
    headers = {"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{file_name}"'}
    if request.method == "HEAD":
        return Response(media_type="application/octet-stream", headers=headers)
    return StreamingResponse(_chunks(runs.artifacts, key, file_name), media_type="application/octet-stream",
                             headers=headers)


def _chunks(artifacts, key: str, name: str) -> Iterator[bytes]:
    """One file of an artifact, streamed from the store in 1 MiB reads."""
    with artifacts.open(key, name) as f:
        while chunk := f.read(CHUNK):
            yield chunk
