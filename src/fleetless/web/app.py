"""The dashboard: a Starlette app that reads through ``insights`` and acts through ``Queue``.

Read-only unless a token is configured (``FLEETLESS_DASHBOARD_TOKEN``). With one, an action
(retry, cancel, run now; pause or resume a queue) needs either ``Authorization: Bearer <token>``
(scripts; browsers never send it on their own, so no CSRF risk), or the session cookie the sign-in form sets plus that
session's CSRF token in the form (the cookie is also ``SameSite=Strict`` and ``HttpOnly``). Without a
token every action answers 403; with one but without credentials, 401; neither changes anything.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from .. import db, metrics
from ..insights import PAGE_SIZE, Insights
from ..queue import JobNotFound, Queue, QueueSettings
from . import pages

__all__ = ["COOKIE", "Auth", "create_app"]

COOKIE = "fleetless_session"
ACTIONS = ("retry", "cancel", "run-now")


class Auth:
    """Stateless sessions: the cookie is ``nonce.mac`` signed with the token, and the CSRF token is
    another MAC of the same nonce. Changing the token signs everyone out."""

    def __init__(self, token: str | None) -> None:
        self.token = token or None

    @property
    def writable(self) -> bool:
        return self.token is not None

    def _mac(self, message: str) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), message.encode(), hashlib.sha256).hexdigest()

    def new_session(self) -> str:
        nonce = secrets.token_hex(16)
        return f"{nonce}.{self._mac('session:' + nonce)}"

    def session_nonce(self, request: Request) -> str | None:
        """The nonce of a valid session cookie, else None."""
        if self.token is None:
            return None
        nonce, _, mac = request.cookies.get(COOKIE, "").partition(".")
        if nonce and hmac.compare_digest(mac, self._mac("session:" + nonce)):
            return nonce
        return None

    def csrf_for(self, nonce: str) -> str:
        return self._mac("csrf:" + nonce)

    def flash_mac(self, job_id: int, text: str) -> str:
        """Signs a message the dashboard itself put in a redirect's ``?problem=``, so that a link
        made elsewhere cannot show its own text in the box on a real job page."""
        return self._mac(f"flash:{job_id}:{text}")[:32] if self.token is not None else ""

    def check_password(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def bearer(self, request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.check_password(given.strip())


def create_app(
    queue: Queue, *, token: str | None = None, hours: float = 3, page_size: int = PAGE_SIZE
) -> Starlette:
    """The dashboard over ``queue``; ``token`` enables actions. Every list is shown ``page_size``
    rows at a time. Database errors reach it only as :class:`fleetless.db.DatabaseError` (the
    queue's one boundary translates the driver's): unavailable or not initialised is a 503 page."""
    insights = Insights(queue)
    auth = Auth(token)

    def root(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def html(request: Request, title: str, body: str, status_code: int = 200) -> HTMLResponse:
        nonce = auth.session_nonce(request)
        page = pages.layout(title, body, root=root(request), csrf=auth.csrf_for(nonce) if nonce else None,
                            writable=auth.writable)
        return HTMLResponse(page, status_code=status_code, headers={
            "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                                       "form-action 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff",
        })

    def bad_request(request: Request, exc: ValueError) -> Response:
        return html(request, "bad request", pages.message_page("Bad request", str(exc)), 400)

    async def overview(request: Request) -> Response:
        try:
            numbers = {name: _page_number(request, name) for name in ("running_page", "kinds_page", "queues_page")}
            o = await run_in_threadpool(lambda: insights.overview(hours, size=page_size, **numbers))
        except ValueError as exc:
            return bad_request(request, exc)
        return html(request, "overview", pages.overview_page(o, root=root(request), hours=hours,
                                                            query=dict(request.query_params)))

    async def jobs(request: Request) -> Response:
        p = request.query_params
        filters = {k: p.get(k) or None for k in ("status", "kind", "queue")}
        try:
            limit = min(int(p.get("limit", page_size)), 500)
            before = int(p["before"]) if p.get("before") else None
            rows = await run_in_threadpool(lambda: insights.jobs(limit=limit, before=before, **filters))
        except ValueError as exc:
            return bad_request(request, exc)
        return html(request, "jobs", pages.jobs_page(rows, root=root(request), filters=filters, limit=limit))

    async def job(request: Request) -> Response:
        job_id = _job_id(request)
        if job_id is None:
            return html(request, "not found", pages.message_page("Not found", "no such job"), 404)
        try:
            number = _page_number(request, "attempts_page")
            row = await run_in_threadpool(insights.job, job_id)
            history = await run_in_threadpool(insights.attempt_runs_page, job_id, number, page_size)
            graph = await run_in_threadpool(insights.graph, job_id)
        except JobNotFound as exc:
            return html(request, "not found", pages.message_page("Not found", str(exc.args[0])), 404)
        except ValueError as exc:
            return bad_request(request, exc)
        nonce = auth.session_nonce(request)
        flash = _flash(request, job_id)
        body = pages.job_page(row, history, root=root(request), csrf=auth.csrf_for(nonce) if nonce else None,
                              writable=auth.writable, flash=flash[0] if flash else None,
                              flash_bad=flash is not None and flash[1], graph=graph)
        return html(request, f"job {job_id}", body)

    async def schedules(request: Request) -> Response:
        try:
            found = await run_in_threadpool(insights.schedules_page, _page_number(request, "page"), page_size)
        except ValueError as exc:
            return bad_request(request, exc)
        return html(request, "schedules", pages.schedules_page(found, root=root(request)))

    async def queues(request: Request) -> Response:
        rows = await run_in_threadpool(insights.queues)
        nonce = auth.session_nonce(request)
        return html(request, "queues", pages.queues_page(rows, root=root(request), writable=auth.writable,
                                                         csrf=auth.csrf_for(nonce) if nonce else None))

    async def allowed(request: Request) -> Response | bool:
        """An action's checks: a token is set, and the request carries it (True: as a bearer; False:
        a signed-in session whose form has its CSRF token). Else the refusal to send."""
        if not auth.writable:
            return _refuse(request, 403, "read-only dashboard: actions need FLEETLESS_DASHBOARD_TOKEN")
        if auth.bearer(request):
            return True
        nonce = auth.session_nonce(request)
        if nonce is None:
            return _refuse(request, 401, "sign in (or send Authorization: Bearer <token>) to act")
        form = await request.form()
        given = str(form.get("csrf", ""))
        if not hmac.compare_digest(given, auth.csrf_for(nonce)):
            return _refuse(request, 403, "missing or wrong CSRF token: reload the page and try again")
        return False

    def queue_action(name: str, call: Callable[[str], QueueSettings]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            checked = await allowed(request)
            if isinstance(checked, Response):
                return checked
            try:
                setting = await run_in_threadpool(call, request.path_params["name"])
            except ValueError as exc:
                if checked:
                    return JSONResponse({"error": str(exc)}, status_code=400)
                return bad_request(request, exc)
            if checked:
                return JSONResponse({"queue": setting.queue, "action": name, "paused": setting.paused,
                                     "concurrency": setting.concurrency})
            return RedirectResponse(f"{root(request)}/queues", status_code=303)

        return endpoint

    def action(name: str, call: Callable[[int], object]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            job_id = _job_id(request)
            checked = await allowed(request)
            if isinstance(checked, Response):
                return checked
            via_bearer = checked
            if job_id is None:
                return _refuse(request, 404, "no such job")
            try:
                await run_in_threadpool(call, job_id)
            except JobNotFound as exc:
                return _refuse(request, 404, str(exc.args[0]))
            except ValueError as exc:
                if via_bearer:
                    return JSONResponse({"error": str(exc)}, status_code=409)
                text = str(exc)
                return RedirectResponse(
                    f"{root(request)}/jobs/{job_id}?problem={_q(text)}&sig={auth.flash_mac(job_id, text)}",
                    status_code=303)
            if via_bearer:
                row = await run_in_threadpool(queue.get, job_id)
                return JSONResponse({"id": job_id, "action": name, "status": row["status"]})
            return RedirectResponse(f"{root(request)}/jobs/{job_id}?done={name}", status_code=303)

        return endpoint

    def _refuse(request: Request, code: int, text: str) -> Response:
        if "text/html" in request.headers.get("accept", ""):
            return html(request, "refused", pages.message_page("Refused", text), code)
        return JSONResponse({"error": text}, status_code=code)

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return html(request, "sign in", pages.login_page(root=root(request), error=None))
        if not auth.writable:
            return html(request, "sign in", pages.login_page(
                root=root(request), error="this dashboard is read-only: FLEETLESS_DASHBOARD_TOKEN is not set"), 403)
        form = await request.form()
        if not auth.check_password(str(form.get("token", ""))):
            return html(request, "sign in", pages.login_page(root=root(request), error="wrong token"), 401)
        response = RedirectResponse(f"{root(request)}/", status_code=303)
        response.set_cookie(COOKIE, auth.new_session(), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path=(root(request) or "/"))
        return response

    def _flash(request: Request, job_id: int) -> tuple[str, bool] | None:
        """The box above a job page after an action: only the names of the dashboard's own actions
        for ``?done=``, and for ``?problem=`` only text this dashboard signed for this job."""
        done = request.query_params.get("done")
        if done in ACTIONS:
            return f"{done}: ok", False
        problem = request.query_params.get("problem")
        given = request.query_params.get("sig", "")
        if problem and auth.writable and hmac.compare_digest(given, auth.flash_mac(job_id, problem)):
            return problem, True
        return None

    async def logout(request: Request) -> Response:
        nonce = auth.session_nonce(request)
        if nonce is not None:
            form = await request.form()
            if not hmac.compare_digest(str(form.get("csrf", "")), auth.csrf_for(nonce)):
                return _refuse(request, 403, "missing or wrong CSRF token: reload the page and try again")
        response = RedirectResponse(f"{root(request)}/", status_code=303)
        response.delete_cookie(COOKIE, path=(root(request) or "/"))
        return response

    async def metrics_endpoint(request: Request) -> Response:
        body = await run_in_threadpool(metrics.render, insights)
        return Response(body, media_type=metrics.CONTENT_TYPE)

    async def database_error(request: Request, exc: Exception) -> Response:
        """What the queue's boundary (``db.errors_translated``) raised, said in one line: 503 when
        the database cannot answer (unavailable, or the schema is not there yet), else 500."""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, db.DatabaseUnavailable):
            return html(request, "database", pages.message_page("Database unavailable", first), 503)
        if isinstance(exc, db.SchemaNotInitialised):
            return html(request, "database", pages.message_page("Schema not initialised", first), 503)
        return html(request, "database", pages.message_page("Database error", first), 500)

    routes = [
        Route("/", overview),
        Route("/jobs", jobs),
        Route("/jobs/{job_id}", job),
        Route("/schedules", schedules),
        Route("/queues", queues),
        Route("/queues/{name}/pause", queue_action("pause", queue.pause_queue), methods=["POST"]),
        Route("/queues/{name}/resume", queue_action("resume", queue.resume_queue), methods=["POST"]),
        Route("/jobs/{job_id}/retry", action("retry", queue.retry), methods=["POST"]),
        Route("/jobs/{job_id}/cancel", action("cancel", queue.cancel), methods=["POST"]),
        Route("/jobs/{job_id}/run-now", action("run-now", queue.run_now), methods=["POST"]),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/metrics", metrics_endpoint),
    ]
    return Starlette(routes=routes, exception_handlers={db.DatabaseError: database_error})


def _page_number(request: Request, name: str) -> int:
    """The page asked for in ``?name=N`` (1 when absent); ValueError naming it when not a number."""
    given = request.query_params.get(name) or "1"
    try:
        return int(given)
    except ValueError:
        raise ValueError(f"{name}={given[:40]!r}: give a page number (1, 2, ...)") from None


def _job_id(request: Request) -> int | None:
    try:
        value = int(request.path_params["job_id"])
    except ValueError:
        return None
    return value if 1 <= value < 2**63 else None


def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text[:200])
