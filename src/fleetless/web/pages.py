"""The dashboard's HTML, rendered on the server. Every value from the table goes through
:func:`fleetless.insights.html_text`; nothing a job wrote can become markup."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from ..insights import Overview, Page, age, attempt_label, html_text

__all__ = ["job_page", "jobs_page", "layout", "login_page", "message_page", "overview_page", "queues_page",
           "schedules_page"]

e = html_text

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:center}
header a{color:#cfd8dc;text-decoration:none}header a:hover{color:#fff}header .who{margin-left:auto}
main{padding:1em 1.2em;max-width:1200px}
h1{font-size:1.3em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;background:#fff;margin-bottom:.8em}
th,td{padding:.25em .7em;border-bottom:1px solid #e0e0e0;text-align:left;vertical-align:top}
th{background:#eceff1;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:.8em;flex-wrap:wrap}
.card{background:#fff;border:1px solid #e0e0e0;padding:.5em 1em;min-width:7em}
.card b{display:block;font-size:1.6em}.dead b{color:#c62828}.running b{color:#1565c0}.pending b{color:#ef6c00}
.done b{color:#2e7d32}
pre{background:#fff;border:1px solid #e0e0e0;padding:.6em;overflow:auto;max-height:30em;white-space:pre-wrap}
.err{color:#c62828}.snoozed{color:#777;font-style:italic}tr.snoozes summary{cursor:pointer}
.pager{margin:.2em 0 .8em}.muted{color:#777}form.inline{display:inline}button{margin-right:.4em}
.flash{background:#e8f5e9;border:1px solid #a5d6a7;padding:.4em .8em;margin-bottom:.8em}
.flash.bad{background:#ffebee;border-color:#ef9a9a}
code{white-space:nowrap}
"""


def layout(title: str, body: str, *, root: str, csrf: str | None, writable: bool) -> str:
    """The page around ``body``; ``csrf`` is the signed-in session's token (None: not signed in),
    which the sign-out form carries like every other form that changes something."""
    who = ""
    if writable:
        who = (f'<form class="inline who" method="post" action="{root}/logout">'
               f'<input type="hidden" name="csrf" value="{e(csrf)}"><button>sign out</button></form>'
               if csrf is not None else f'<a class="who" href="{root}/login">sign in for actions</a>')
    else:
        who = '<span class="who muted">read-only</span>'
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width'><title>{e(title)} · fleetless</title>"
        f"<style>{STYLE}</style></head><body><header><b>fleetless</b>"
        f'<a href="{root}/">overview</a><a href="{root}/jobs">jobs</a>'
        f'<a href="{root}/jobs?status=dead">dead</a><a href="{root}/jobs?status=running">running</a>'
        f'<a href="{root}/queues">queues</a><a href="{root}/schedules">schedules</a>'
        f'<a href="{root}/metrics">metrics</a>{who}</header>'
        f"<main>{body}</main></body></html>"
    )


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[int] = (),
           table_id: str = "") -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _pager(page: Page[Any], href: str, query: Mapping[str, str], param: str, ident: str) -> str:
    """Links to the previous and next page of a list, keeping the page's other parameters."""
    if page.number == 1 and not page.more:
        return ""
    links = []
    if page.number > 1:
        links.append(f'<a id="{ident}-prev" href="{href}?{e(urlencode({**query, param: page.number - 1}))}">'
                     "← previous</a>")
    links.append(f"page {page.number}")
    if page.more:
        links.append(f'<a id="{ident}-next" href="{href}?{e(urlencode({**query, param: page.number + 1}))}">'
                     "next →</a>")
    return f'<p class="pager">{" · ".join(links)}</p>'


#: The chart shows at least this many minutes, however recent the first activity.
CHART_MIN_MINUTES = 30


def _charted(per_minute: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The minutes the chart draws: the quiet minutes before the window's first activity are left
    out (down to CHART_MIN_MINUTES), so that a queue that started a few minutes ago fills the chart
    instead of a sliver at its right edge."""
    busy = [i for i, m in enumerate(per_minute) if m["done"] or m["failed"]]
    start = min(busy[0], max(len(per_minute) - CHART_MIN_MINUTES, 0)) if busy else 0
    return per_minute[start:]


def _span(minutes: int) -> str:
    """``30 min``, ``3 h``, ``2.5 h``."""
    return f"{minutes} min" if minutes < 120 else f"{minutes / 60:g} h"


def _chart(per_minute: Sequence[Mapping[str, Any]]) -> str:
    """Attempts done (green) and failed (red) per minute (:func:`_charted`'s) as stacked bars in inline SVG."""
    if not per_minute:
        return ""
    width, height, bar = 720, 120, 720 / len(per_minute)
    top = max([m["done"] + m["failed"] for m in per_minute] + [1])
    bars = []
    for i, m in enumerate(per_minute):
        x = i * bar
        done_h = m["done"] / top * (height - 14)
        failed_h = m["failed"] / top * (height - 14)
        label = f"{m['minute']:%H:%M} UTC: {m['done']} done, {m['failed']} failed"
        bars.append(
            f'<g><title>{e(label)}</title>'
            f'<rect x="{x:.1f}" y="{height - done_h:.1f}" width="{max(bar - 0.5, 0.5):.1f}" '
            f'height="{done_h:.1f}" fill="#43a047"/>'
            f'<rect x="{x:.1f}" y="{height - done_h - failed_h:.1f}" width="{max(bar - 0.5, 0.5):.1f}" '
            f'height="{failed_h:.1f}" fill="#e53935"/></g>'
        )
    first, last = per_minute[0]["minute"], per_minute[-1]["minute"]
    return (
        f'<svg id="per-minute" width="{width}" height="{height + 16}" role="img" '
        f'aria-label="jobs finished and failed per minute">'
        f'<rect width="{width}" height="{height}" fill="#fff" stroke="#e0e0e0"/>{"".join(bars)}'
        f'<text x="0" y="{height + 13}" font-size="11" fill="#777">{first:%H:%M} UTC</text>'
        f'<text x="{width}" y="{height + 13}" font-size="11" fill="#777" text-anchor="end">{last:%H:%M} UTC</text>'
        f'<text x="4" y="12" font-size="11" fill="#777">max {top}/min</text></svg>'
    )


def _by(title: str, counts: Page[tuple[str, dict[str, int]]], statuses: Sequence[str], root: str,
        param: str, table_id: str, query: Mapping[str, str]) -> str:
    rows = []
    for name, c in counts.rows:
        link = f'<a href="{root}/jobs?{e(urlencode({param: name}))}">{e(name)}</a>'
        rows.append([link] + [str(c.get(s, 0)) for s in statuses])
    table = (_table([param, *statuses], rows, range(1, len(statuses) + 1), table_id) if rows
             else '<p class="muted">none</p>')
    return f"<h2>{e(title)}</h2>{table}" + _pager(counts, f"{root}/", query, f"{param}s_page", table_id)


def overview_page(o: Overview, *, root: str, hours: float, query: Mapping[str, str] | None = None) -> str:
    query = dict(query or {})
    statuses = list(o.by_status)
    cards = "".join(
        f'<a href="{root}/jobs?status={s}" style="text-decoration:none;color:inherit">'
        f'<div class="card {s}" id="count-{s}"><b>{n}</b>{s}</div></a>'
        for s, n in o.by_status.items()
    )
    running_rows = [
        [f'<a href="{root}/jobs/{r["id"]}">{r["id"]}</a>', e(r["kind"]), e(r["queue"]), e(r["claimed_by"] or "-"),
         e(r["tier"] or "-"), str(r["attempts"]), age(r["elapsed_seconds"])]
        for r in o.running.rows
    ]
    running = (_table(["id", "kind", "queue", "drainer", "tier", "attempt", "elapsed"], running_rows, (0, 5, 6),
                      "running") if running_rows else '<p class="muted">nothing is running</p>')
    running += _pager(o.running, f"{root}/", query, "running_page", "running")
    finished = sum(m["done"] for m in o.per_minute)
    failed = sum(m["failed"] for m in o.per_minute)
    # titled by the span the axis shows: "last 3 h" over a 30-minute axis misled (issue 28); the
    # minutes left out are quiet, so the counts are the whole window's
    shown = _charted(o.per_minute)
    window = round(hours * 60)
    quiet = (f' <span class="muted" id=chart-quiet>(nothing earlier in the last {_span(window)})</span>'
             if len(shown) < len(o.per_minute) else "")
    return (
        f"<h1>Overview</h1><div class=cards>{cards}</div>"
        f"<p>total <b id=total>{o.total}</b> · oldest due job waiting "
        f"<b id=oldest-due>{age(o.oldest_due_age_seconds)}</b> · next due in {age(o.next_due_in_seconds)}</p>"
        f"<h2 id=chart-title>Attempts per minute, last {_span(len(shown))} (<span id=attempts-done>{finished}</span>"
        f" done, <span id=attempts-failed>{failed}</span> failed){quiet}</h2>{_chart(shown)}"
        f"<h2>Running now</h2>{running}"
        + _by("By kind", o.by_kind, statuses, root, "kind", "by-kind", query)
        + _by("By queue", o.by_queue, statuses, root, "queue", "by-queue", query)
    )


def jobs_page(rows: Sequence[Mapping[str, Any]], *, root: str, filters: Mapping[str, str | None],
              limit: int) -> str:
    active = {k: v for k, v in filters.items() if v}
    title = "Jobs" + "".join(f" · {k} {v}" for k, v in active.items())
    table_rows = [
        [f'<a href="{root}/jobs/{r["id"]}">{r["id"]}</a>', e(r["kind"]), e(r["queue"]), e(r["status"]),
         f'{r["attempts"]}/{r["max_attempts"]}', _when(r["run_after"]), _when(r["finished_at"]),
         _error_cell(r["error_head"], snoozed=r["snoozed"])]
        for r in rows
    ]
    body = f"<h1>{e(title)}</h1>"
    body += _table(["id", "kind", "queue", "status", "attempts", "run after", "finished", "error"], table_rows,
                   (0, 4), "jobs") if rows else '<p class="muted">no jobs</p>'
    if len(rows) == limit:
        nxt = urlencode({**active, "before": rows[-1]["id"], "limit": limit})
        body += f'<p><a id="next-page" href="{root}/jobs?{nxt}">older jobs →</a></p>'
    return body


def _error_cell(head: str | None, *, snoozed: bool) -> str:
    """An error column's cell: red for an error; a snooze's note muted, as it is not one (issue 28)."""
    return f'<span class="{"snoozed" if snoozed else "err"}">{e(head or "")}</span>'


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return '<span class="muted">-</span>'
    return e(value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))


_ACTIONS = {"retry": ("dead", "cancelled"), "cancel": ("pending", "running", "waiting"), "run-now": ("pending",)}


def _unusable(button_id: str, action: str, target: str, *, writable: bool) -> str:
    """An action's button where it would be refused: greyed, its title saying why. Read-only (no
    FLEETLESS_DASHBOARD_TOKEN) or signed out alike: an active button led to a refusal page
    (newcomer review, issue 28); signed out, the sign-in link beside the buttons is the way on."""
    hint = "sign in for actions" if writable else "read-only: FLEETLESS_DASHBOARD_TOKEN is not set"
    return (f'<form class="inline" method="post" action="{target}">'
            f'<button id="{button_id}" title="{e(hint)}" disabled>{action}</button></form>')


def _sign_in(root: str, writable: bool, csrf: str | None) -> str:
    """Beside greyed buttons of a signed-out viewer of a dashboard with a token: how to act."""
    if csrf is not None or not writable:
        return ""
    return f'<a class="sign-in-hint" id="sign-in-hint" href="{root}/login">sign in to act</a>'


def job_page(job: Mapping[str, Any], attempts: Page[dict[str, Any]], *, root: str, csrf: str | None,
             writable: bool, flash: str | None, flash_bad: bool, graph: Mapping[str, Any] | None = None) -> str:
    buttons = []
    for action, statuses in _ACTIONS.items():
        if job["status"] not in statuses:
            continue
        if csrf is not None:
            buttons.append(
                f'<form class="inline" method="post" action="{root}/jobs/{job["id"]}/{action}">'
                f'<input type="hidden" name="csrf" value="{e(csrf)}"><button id="{action}">{action}</button></form>')
        else:
            buttons.append(_unusable(action, action, f'{root}/jobs/{job["id"]}/{action}', writable=writable))
    if buttons:
        buttons.append(_sign_in(root, writable, csrf))
    fields = ["status", "kind", "queue", "priority", "attempts", "max_attempts", "snoozes", "run_after", "created_at",
              "started_at", "finished_at", "lease_expires_at", "timeout_seconds", "claimed_by", "tier"]
    if job.get("on_parent_failure") is not None:  # a workflow's child
        fields += ["parents_left", "on_parent_failure"]
    rows = [[e(f), _when(job.get(f)) if isinstance(job.get(f), dt.datetime) else
             f'<span id="field-{f}">{e(job.get(f) if job.get(f) is not None else "-")}</span>']
            for f in fields if f in job]
    body = f"<h1>Job {job['id']} <span class=muted>{e(job['kind'])}</span></h1>"
    if flash:
        body += f'<div class="flash{" bad" if flash_bad else ""}" id="flash">{e(flash)}</div>'
    body += "".join(buttons)
    body += _table(["field", "value"], rows, (), "fields")
    body += f"<h2>Payload</h2><pre id=payload>{e(json.dumps(job.get('payload'), indent=2, ensure_ascii=False))}</pre>"
    if job.get("error_head") and job.get("snoozed"):  # a snooze's note: not an error (issue 28)
        body += f'<h2>Snoozed</h2><p class="snoozed" id="snooze-note">{e(job["error_head"])}</p>'
        if (job.get("last_error") or "").strip() != job["error_head"]:
            body += f"<pre id=snooze-detail>{e(job.get('last_error') or '')}</pre>"
    elif job.get("error_head"):
        body += f'<h2>Error</h2><p class="err" id="error-head">{e(job["error_head"])}</p>'
        if (job.get("last_error") or "").strip() != job["error_head"]:  # a one-line error once, not twice
            body += f"<pre id=last-error>{e(job.get('last_error') or '')}</pre>"
    # an empty stdout is no box (an empty "Result" box looked like output lost: issue 28)
    if job.get("result_json") is not None:  # what a handle() returned; what it printed is "result"
        body += (f"<h2>Result</h2><pre id=result-json>"
                 f"{e(json.dumps(job['result_json'], indent=2, ensure_ascii=False))}</pre>")
        if job.get("result"):
            body += f"<h2>Output</h2><pre id=result>{e(job['result'])}</pre>"
    elif job.get("result"):
        body += f"<h2>Result</h2><pre id=result>{e(job['result'])}</pre>"
    body += "<h2>Attempts</h2>" + (_attempts(attempts.rows) if attempts.rows
                                   else '<p class="muted">no attempt has ended yet</p>')
    return body + _pager(attempts, f"{root}/jobs/{job['id']}", {}, "attempts_page", "attempts") + _graph(graph, root)


_ATTEMPT_HEADERS = ["#", "outcome", "drainer", "tier", "started", "took", "ended", "kill reason", "error"]


def _attempts(rows: Sequence[Mapping[str, Any]]) -> str:
    """The attempt history (Insights.attempt_runs_page): a snooze's note muted, not red, and each
    run of consecutive snoozes one row, ``snoozed N times between T1 and T2``, its rows in a
    <details> (a job at the snooze cap listed 100 rows around the attempts that matter: issue 28)."""
    body = []
    for a in rows:
        snoozed = a["outcome"] == "snoozed"
        if a.get("run"):
            run = a["run"]
            nths = [r["snooze"] for r in run if r["snooze"] is not None]
            label = f'{a["attempt"]} (snoozes {nths[0]}-{nths[-1]})' if nths else f'{a["attempt"]} (snoozes)'
            items = "".join(f'<li>{_when(r["finished_at"])} <span class="snoozed">{e(r["error_head"] or "")}</span>'
                            f"</li>" for r in run)
            body.append(
                f'<tr class="snoozes"><td class="n">{e(label)}</td><td class="snoozed">snoozed</td>'
                f'<td colspan="{len(_ATTEMPT_HEADERS) - 2}"><details><summary>snoozed {a["n"]} times between '
                f'{_when(a["run_started"])} and {_when(a["run_finished"])}</summary><ol>{items}</ol>'
                "</details></td></tr>")
            continue
        cells = [e(attempt_label(a)), f'<span class="snoozed">{e(a["outcome"])}</span>' if snoozed else e(a["outcome"]),
                 e(f'{a["host"]}:{a["pid"]}' if a.get("host") else "-"), e(a["tier"] or "-"), _when(a["started_at"]),
                 "-" if a["duration_seconds"] is None else f'{a["duration_seconds"]:.1f} s',
                 e(a["signal"] or (a["exit_code"] if a["exit_code"] is not None else "-")), e(a["kill_reason"] or ""),
                 _error_cell(a["error_head"], snoozed=snoozed)]
        body.append("<tr>" + "".join(f'<td class="n">{c}</td>' if i in (0, 5) else f"<td>{c}</td>"
                                     for i, c in enumerate(cells)) + "</tr>")
    head = "".join(f"<th>{e(h)}</th>" for h in _ATTEMPT_HEADERS)
    return f'<table id="attempts"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _graph(graph: Mapping[str, Any] | None, root: str) -> str:
    """A workflow's job: its parents and children (the first of each, linked), and its children by status."""
    if not graph or not (graph["n_parents"] or graph["n_children"]):
        return ""
    body = "<h2>Workflow</h2>"
    for what in ("parents", "children"):
        shown, total = graph[what], graph[f"n_{what}"]
        if not total:
            continue
        rows = [[f'<a href="{root}/jobs/{r["id"]}">{r["id"]}</a>', e(r["kind"]), e(r["status"]),
                 _when(r["finished_at"])] for r in shown]
        more = f", the first {len(shown)} shown" if total > len(shown) else ""
        body += f"<h3>{what.capitalize()} ({total}{more})</h3>"
        body += _table(["id", "kind", "status", "finished"], rows, (0,), what)
    if graph["n_children"]:
        counts = ", ".join(f"{e(k)} {v}" for k, v in sorted(graph["children_by_status"].items()))
        body += f'<p id="children-by-status">children by status: {counts}</p>'
    return body


def queues_page(rows: Sequence[Mapping[str, Any]], *, root: str, csrf: str | None, writable: bool) -> str:
    """Every queue with jobs or settings: running or paused, its concurrency, its counts, and a
    pause or resume button (a form with the session's CSRF token, as the job page's actions)."""
    body = "<h1>Queues</h1>"
    if not rows:
        return body + '<p class="muted">no queues yet</p>'
    table_rows = []
    for r in rows:
        action = "resume" if r["paused"] else "pause"
        target = f'{root}/queues/{e(r["queue"])}/{action}'
        if csrf is not None:
            button = (f'<form class="inline" method="post" action="{target}"><input type="hidden" name="csrf"'
                      f' value="{e(csrf)}"><button id="{action}-{e(r["queue"])}">{action}</button></form>')
        else:
            button = _unusable(f'{action}-{e(r["queue"])}', action, target, writable=writable)
        state = '<span class="err">paused</span>' if r["paused"] else "running"
        table_rows.append([
            f'<a href="{root}/jobs?{urlencode({"queue": r["queue"]})}">{e(r["queue"])}</a>', state,
            e("-" if r["concurrency"] is None else r["concurrency"]),
            *(str(r[s]) for s in ("pending", "running", "done", "dead", "cancelled", "waiting")), button])
    return body + _table(["queue", "state", "concurrency", "pending", "running", "done", "dead", "cancelled",
                          "waiting", ""], table_rows, (2, 3, 4, 5, 6, 7, 8), "queues") + _sign_in(root, writable, csrf)


def schedules_page(found: Page[dict[str, Any]], *, root: str) -> str:
    rows = found.rows
    table_rows = [
        [e(r["name"]), f"<code>{e(r['cron'])}</code>", e(r["timezone"]),
         f'<a href="{root}/jobs?{urlencode({"kind": r["kind"]})}">{e(r["kind"])}</a>', e(r["queue"]),
         f"<code>{e(json.dumps(r['payload'], ensure_ascii=False))}</code>", _when(r["last"]), _when(r["next"])]
        for r in rows
    ]
    body = "<h1>Schedules</h1>"
    if not table_rows:
        if found.number > 1:
            return body + '<p class="muted">no schedules on this page</p>' + _pager(
                found, f"{root}/schedules", {}, "page", "schedules")
        return body + '<p class="muted">no schedules (fleetless schedule add NAME --cron ... KIND PAYLOAD)</p>'
    return body + _table(["name", "cron", "timezone", "kind", "queue", "payload", "last enqueued", "next due"],
                         table_rows, (), "schedules") + _pager(found, f"{root}/schedules", {}, "page", "schedules")


def login_page(*, root: str, error: str | None) -> str:
    err = f'<p class="err" id="login-error">{e(error)}</p>' if error else ""
    return (
        f"<h1>Sign in</h1>{err}<form method=post action='{root}/login'>"
        "<label>dashboard token <input type=password name=token id=token autocomplete=current-password></label> "
        "<button id=sign-in>sign in</button></form>"
        "<p class=muted>The token is FLEETLESS_DASHBOARD_TOKEN as the server was started with.</p>"
    )


def message_page(title: str, text: str) -> str:
    return f"<h1>{e(title)}</h1><p class=err id=message>{e(text)}</p>"
