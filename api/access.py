"""Who is calling: the bearer-token dependency every user-facing route takes (api.app and api.openai_api); and the
check both upload routes (POST /files, POST /v1/files) take after it, that the body holds one file.

A token with the user or admin scope passes; an admin sees every owner's jobs and files (`visible_owner` None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from core import auth
from core.db import session_scope
from core.errors import Forbidden, InvalidInput

bearer = HTTPBearer(
    auto_error=False,
    description="A token from `gpujobs tokens create` (scope user or admin); "
    "`gpujobs up` writes a local admin token to $JOBS_HOME/token.",
)


@dataclass(frozen=True)
class Principal:
    owner: str
    scopes: frozenset[str]

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def may_prioritize(self) -> bool:
        """Whether this caller may submit `priority: high` work (core/scheduling.py)."""
        return self.is_admin or "priority" in self.scopes

    @property
    def visible_owner(self) -> str | None:
        """The owner filter for reads and changes: None (everything) for admins."""
        return None if self.is_admin else self.owner


def principal(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    with session_scope() as session:
        token = auth.authenticate(session, credentials.credentials if credentials else None)
        owner, scopes = token.owner, frozenset(token.scopes.split(","))
    if not scopes & {"user", "admin"}:
        raise Forbidden(
            f"this token has only the scope(s) {', '.join(sorted(scopes))}: jobs, files, batches and usage "
            "need a token with the user or admin scope (`gpujobs tokens create --owner NAME`)"
        )
    return Principal(owner=owner, scopes=scopes)


Caller = Annotated[Principal, Depends(principal)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]  # the bearer token as sent


async def one_file_part(request: Request) -> None:
    """An upload holds one part named `file`: FastAPI binds the last of several and would drop the others without a
    word. The form was parsed already (FastAPI read the body first); this reads it again from the request's cache."""
    parts = (await request.form()).getlist("file")
    if len(parts) > 1:
        raise InvalidInput(
            f"the upload holds {len(parts)} parts named file: send exactly one part named file (one upload per file)",
            param="file",
        )


OneFile = Annotated[None, Depends(one_file_part)]  # after the Caller: a request without a token gets its 401 first
