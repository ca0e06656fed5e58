"""The console's pages (docs/console.md): runs, a run's live curves, checkpoints, usage and cost, the
queue and quotas. Every page is for the signed-in account only, through the same ownership checks as
the API (control/sessions.py: Sessions.lookup): another account's run or checkpoint answers 404, like a missing one.
Mutations (publish, unpublish, delete) call the same Runs methods as the REST routes, so they are
audited the same way."""

from __future__ import annotations

import functools
import inspect
import math
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from tinkerd.api.console import session
from tinkerd.api.console.charts import chart, fmt
from tinkerd.api.deps import _source, state
from tinkerd.api.routes.export import download_urls
from tinkerd.control import costs, overview
from tinkerd.control.metering import TOKEN_KINDS
from tinkerd.control.ids import TYPE_SEGMENTS, parse_tinker_path
from tinkerd.control.stepmetrics import StepMetrics, series
from tinkerd.control.storage import STORAGE_KIND
from tinkerd.control.clock import utcnow
from tinkerd.errors import NotFoundError, TinkerdError, UserError

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
# Rows per page of runs and checkpoints: a phone screen's few scrolls, one short query.
PAGE = 50
DONE = {"publish": "published", "unpublish": "unpublished", "delete": "deleted"}
MAX_USAGE_DAYS = 14  # the billing API's widest window (api/routes/admin.py)
KIND_LABELS = {"trained_tokens": "trained tokens", "forward_tokens": "forward-only tokens",
               "prefill_tokens": "sampling prefill tokens", "sampled_tokens": "sampled tokens",
               STORAGE_KIND: "checkpoint storage (GB-hours)"}

router = APIRouter(prefix="/console", include_in_schema=False)


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _when(dt: datetime | None) -> str:
    return "" if dt is None else dt.strftime("%Y-%m-%d %H:%M:%S")


def _ttl(expires: datetime | None, now: datetime) -> str:
    if expires is None:
        return "kept"
    left = (expires - now).total_seconds()
    if left <= 0:
        return "expired"
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if left >= s:
            return f"{left / s:.1f} {unit}"
    return f"{left:.0f} s"


templates.env.filters.update(size=_size, when=_when, num=fmt, usd=lambda v: f"${v:,.4f}",
                             count=lambda v: f"{int(v):,}", gbh=lambda v: f"{v:.6f}")


def render(request: Request, name: str, status_code: int = 200, **context) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context, status_code=status_code,
                                      headers={"Cache-Control": "no-store"})


def page(fn):
    """A console page: signs the viewer in (else redirects to the sign-in page) and shows the
    request's errors as an HTML page with their status (404 for another account's things)."""

    @functools.wraps(fn)
    async def wrapper(request: Request, *args, **kwargs):
        try:
            who = await run_in_threadpool(session.viewer, request)  # a key lookup: off the event loop
        except session.SignInRequired as e:
            if request.method == "GET" and not request.url.path.endswith("/curves"):
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse(f"/console/signin?{urlencode({'next': target})}", status_code=303)
            return render(request, "error.html", e.status_code, who=None, title="Sign in", message=e.message)
        try:
            if inspect.iscoroutinefunction(fn):  # reads its form on the loop, then sends its work to the pool
                return await fn(request, who, *args, **kwargs)
            return await run_in_threadpool(fn, request, who, *args, **kwargs)  # store queries: in the pool
        except TinkerdError as e:
            return render(request, "error.html", e.status_code, who=who, title=f"{e.status_code}", message=e.message)

    # FastAPI reads the route's parameters from this signature: `who` is ours, not the request's.
    sig = inspect.signature(fn)
    wrapper.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "who"])
    return wrapper


def _page_number(value: str | None) -> int:
    if value is None or value == "":
        return 1
    if not value.isdigit() or not 1 <= int(value) <= 10**9:
        raise UserError(f"page must be a whole number from 1, got {value!r}")
    return int(value)


def _pages(total: int, current: int) -> dict:
    last = max(1, math.ceil(total / PAGE))
    return {"current": current, "last": last, "total": total}


# -- sign-in -----------------------------------------------------------------------------------------


def _next(target: str | None) -> str:
    # Only a console path: never a redirect off this server (an open redirect) or to another prefix.
    if target and target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/console/runs"


@router.get("")
@router.get("/")
async def home() -> Response:
    return RedirectResponse("/console/runs", status_code=303)


@router.get("/signin")
async def signin_form(request: Request, next: str | None = None) -> Response:
    return render(request, "signin.html", who=None, next=_next(next), message=None)


@router.post("/signin")
async def signin(request: Request) -> Response:
    st = state(request)
    try:
        fields = await session.form(request)
    except TinkerdError as e:
        return render(request, "signin.html", e.status_code, who=None, next="/console/runs", message=e.message)
    key = fields.get("api_key", "").strip()
    row = await run_in_threadpool(st.accounts.key_row, key) if key else None
    if row is None or row.revoked_at is not None:
        # audited as the API's refusals are
        await run_in_threadpool(st.accounts.auth_failed, key or None, _source(request))
        return render(request, "signin.html", 401, who=None, next=_next(fields.get("next")),
                      message="That API key is not valid here (unknown or revoked).")
    response = RedirectResponse(_next(fields.get("next")), status_code=303)
    session.start(request, response, row.account_id, row.key_id)
    return response


@router.post("/signout")
@page
async def signout(request: Request, who: session.Viewer) -> Response:
    session.check_csrf(who, await session.form(request))
    response = RedirectResponse("/console/signin", status_code=303)
    session.end(response)
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        raise NotFoundError(f"no console file {name!r}")
    return FileResponse(HERE / "static" / name, media_type=STATIC[name], headers={"Cache-Control": "max-age=300"})


# -- runs --------------------------------------------------------------------------------------------


@router.get("/runs")
@page
def runs_page(request: Request, who: session.Viewer) -> Response:
    current = _page_number(request.query_params.get("page"))
    rows, total = overview.run_page(state(request).control.store, who.account_id, PAGE, (current - 1) * PAGE)
    return render(request, "runs.html", who=who, runs=rows, pages=_pages(total, current), nav="runs")


def _curves(request: Request, model_id: str) -> list:
    points = StepMetrics(state(request).control.store).points(model_id)
    by_name = series(points)
    # The loss first (what a user looks for), then the other metrics by name.
    names = sorted(by_name, key=lambda n: (not n.startswith("loss"), n.startswith("eval "), n))
    return [chart(n, by_name[n]) for n in names]


@router.get("/runs/{run_id}")
@page
def run_page(request: Request, who: session.Viewer, run_id: str) -> Response:
    st = state(request)
    run = st.runs.training_runs.owned_run(run_id, who.account_id)
    now = utcnow()
    start = run.created_at.replace(minute=0, second=0, microsecond=0)
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    cost = costs.run_usage(st.control.store, st.runs.storage, who.account_id, start, end, now).get(run_id, costs.Costed())
    checkpoints, _ = st.runs.checkpoints.list_checkpoints(model_id=run_id, limit=PAGE)
    return render(request, "run.html", who=who, nav="runs", run=overview.run_summary(st.control.store, run),
                  charts=_curves(request, run_id), samplers=overview.sampling_activity(st.control.store, run_id),
                  checkpoints=checkpoints, cost=cost, cost_usd=cost.cost_usd(st.config),
                  total_usd=cost.total_usd(st.config), kinds=KIND_LABELS, now=now, ttl=_ttl,
                  segments=TYPE_SEGMENTS)


@router.get("/runs/{run_id}/curves")
@page
def run_curves(request: Request, who: session.Viewer, run_id: str) -> Response:
    """The curves alone: the run page re-fetches this every few seconds (static/console.js)."""
    state(request).runs.training_runs.owned_run(run_id, who.account_id)
    return render(request, "curves.html", charts=_curves(request, run_id))


# -- checkpoints -------------------------------------------------------------------------------------


@router.get("/checkpoints")
@page
def checkpoints_page(request: Request, who: session.Viewer) -> Response:
    st = state(request)
    current = _page_number(request.query_params.get("page"))
    rows, total = st.runs.checkpoints.list_checkpoints(limit=PAGE, offset=(current - 1) * PAGE, account_id=who.account_id)
    bases = st.runs.training_runs.base_models(r.model_id for r in rows)
    downloads = {r.tinker_path: download_urls(request, r)[0] for r in rows if r.checkpoint_type == "external"}
    return render(request, "checkpoints.html", who=who, nav="checkpoints", checkpoints=rows, bases=bases,
                  downloads=downloads, pages=_pages(total, current), now=utcnow(), ttl=_ttl,
                  done=request.query_params.get("done"))


@router.post("/checkpoints/{action}")
@page
async def checkpoint_action(request: Request, who: session.Viewer, action: str) -> Response:
    fields = await session.form(request)
    session.check_csrf(who, fields)
    runs = state(request).runs
    path = parse_tinker_path(fields.get("tinker_path", ""))
    if action in ("publish", "unpublish"):
        await run_in_threadpool(runs.checkpoints.set_public, path, action == "publish", who.account_id)
    elif action == "delete":
        await run_in_threadpool(runs.checkpoints.delete_checkpoint, path, who.account_id)  # its rmtree: in the pool
    else:
        raise NotFoundError(f"no checkpoint action {action!r}; publish, unpublish or delete")
    back = _next(fields.get("back"))
    sep = "&" if "?" in back else "?"
    return RedirectResponse(f"{back}{sep}done={quote(f'{DONE[action]} {path}')}", status_code=303)


# -- usage and cost ----------------------------------------------------------------------------------


@router.get("/usage")
@page
def usage_page(request: Request, who: session.Viewer) -> Response:
    st = state(request)
    days_text = request.query_params.get("days", "1")
    if not days_text.isdigit() or not 1 <= int(days_text) <= MAX_USAGE_DAYS:
        raise UserError(f"days must be 1 to {MAX_USAGE_DAYS}, got {days_text!r}")
    days = int(days_text)
    now = utcnow()
    # Whole UTC hours, as the billing API's buckets: the window ends with the current hour.
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - timedelta(days=days)
    total = costs.account_usage(st.control.store, st.control.meter, st.runs.storage, who.account_id, start, end, now)
    by_run = costs.run_usage(st.control.store, st.runs.storage, who.account_id, start, end, now)
    ordered = sorted(by_run.items(), key=lambda kv: (kv[0] is None, -kv[1].total_usd(st.config), kv[0] or ""))
    return render(request, "usage.html", who=who, nav="usage", days=days, start=start, end=end, now=now,
                  total=total, total_usd=total.cost_usd(st.config), grand_usd=total.total_usd(st.config),
                  by_run=ordered, config=st.config, prices=costs.prices(st.config), kinds=KIND_LABELS,
                  token_kinds=TOKEN_KINDS, storage_kind=STORAGE_KIND, max_days=MAX_USAGE_DAYS)


# -- queue and limits --------------------------------------------------------------------------------


@router.get("/queue")
@page
def queue_page(request: Request, who: session.Viewer) -> Response:
    control = state(request).control
    ops = overview.queue_view(control, who.account_id)
    quotas = overview.quota_use(control.scheduler.quotas, who.account_id)
    return render(request, "queue.html", who=who, nav="queue", ops=ops, quotas=quotas)
