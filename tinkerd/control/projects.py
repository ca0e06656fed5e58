"""Projects: a named grouping of one account's sessions, and through them of their training runs,
sampling sessions and checkpoints (the SDK's `project_id` on create_session, ServiceClient and
TINKER_PROJECT_ID, `RestClient.assign_session_project`, copy_weights' destination, and the
project filters of list_training_runs, search_sessions and checkpoint storage).

tinkerd has no console to create projects in, so a project exists once one of the account's
sessions is in it: created with a project_id, moved there, or made by a copy into it. Project ids
are per account: two accounts' projects of the same name are two projects, and naming a project
your account has no session in answers 404, as any unknown or foreign id does. A session's project
can be changed but not cleared (the SDK documents that).
"""

from __future__ import annotations

from tinkerd.control.ids import check_name
from tinkerd.control.store.db import Store
from tinkerd.control.store.sessions import SessionRepository
from tinkerd.errors import NotFoundError


def check_project_id(project_id, field: str = "project_id") -> str:
    return check_name(project_id, field)


def require(store: Store, account_id: str, project_ids: list[str], field: str = "project_id") -> None:
    """NotFoundError naming the first project the account has no session in."""
    for pid in project_ids:
        check_project_id(pid, field)
    known = SessionRepository(store).projects_in(account_id, project_ids)
    for pid in project_ids:
        if pid not in known:
            raise NotFoundError(f"unknown {field} {pid!r}")
