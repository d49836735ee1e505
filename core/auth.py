"""API tokens: stored as SHA-256 only, each with an owner and scopes (`user`, `admin`, `metrics`, `priority`: may
submit `priority: high` jobs, beside `user`; an admin may too)."""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import InvalidInput, Unauthorized
from core.models import Token
from core.store import new_id, now

SCOPES = ("user", "admin", "metrics", "priority")
# The name jobs are filed under: no spaces, no control characters. Written out rather than with \s, so that the API
# document's pattern (api/app.py) means the same in Python, in Rust's regex (pydantic) and in JSON Schema's (ECMA).
OWNER_PATTERN = r"^[^\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]{1,128}$"
OWNER = re.compile(OWNER_PATTERN)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_owner(owner: str) -> str:
    """An owner name as jobs are filed under it: what a token is created for and what a quota is set on."""
    if not OWNER.fullmatch(owner):
        raise InvalidInput(f"owner {owner!r}: give a name of 1 to 128 characters without spaces or control characters")
    return owner


def create_token(session: Session, *, owner: str, scopes: list[str], name: str | None = None) -> str:
    """Create a token and return its secret; only its hash is stored, so it is shown once."""
    bad = sorted(set(scopes) - set(SCOPES))
    if bad or not scopes:
        raise InvalidInput(f"unknown scope(s) {bad or scopes}: use {', '.join(SCOPES)}")
    check_owner(owner)
    secret = "jt_" + secrets.token_urlsafe(32)
    scope_list = ",".join(s for s in SCOPES if s in scopes)
    session.add(
        Token(id=new_id("tok"), sha256=digest(secret), owner=owner, scopes=scope_list, name=name, created_at=now())
    )
    return secret


def authenticate(session: Session, secret: str | None) -> Token:
    if not secret:
        raise Unauthorized("missing bearer token: set JOBS_TOKEN, or run `gpujobs up` which writes a local admin token")
    token = session.scalar(select(Token).where(Token.sha256 == digest(secret)))
    if token is None or token.revoked_at is not None:
        raise Unauthorized(
            "invalid or revoked token: check JOBS_TOKEN (an admin can create one with `gpujobs tokens create`)"
        )
    return token


def revoke(session: Session, token_id: str) -> None:
    token = session.get(Token, token_id)
    if token is None:
        raise InvalidInput(f"no token {token_id!r}: `gpujobs tokens list` shows the ids")
    token.revoked_at = token.revoked_at or now()


def list_tokens(session: Session) -> list[Token]:
    return list(session.scalars(select(Token).order_by(Token.created_at)).all())
