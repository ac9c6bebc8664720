"""POST /admin/reload: swap to INDEX_DIR/current now, guarded by DUET_ADMIN_TOKEN."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from app.deps import SettingsDep
from app.errors import AdminDisabled, IndexRefused, NotReady, Unauthorized, documented
from app.reload import IndexReloader

router = APIRouter(tags=["ops"])


def _check_token(settings: SettingsDep, authorization: str | None) -> None:
    token = settings.admin_token.get_secret_value() if settings.admin_token else ""
    if not token:
        raise AdminDisabled(
            "POST /admin/reload is disabled: set DUET_ADMIN_TOKEN and send it "
            "as 'Authorization: Bearer <token>'"
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise Unauthorized(
            "missing or wrong admin token: send 'Authorization: Bearer <DUET_ADMIN_TOKEN>'"
        )


@router.post("/admin/reload", responses=documented(401, 403, 409, 503))
async def reload_index(
    request: Request, settings: SettingsDep, authorization: str | None = Header(None)
) -> JSONResponse:
    """Load INDEX_DIR/current, check it and swap it in (also retries a refused version).

    200 {"result": "swapped" | "current", "version", ...}; 409 index_refused when the version
    is broken (the old one keeps serving); 401 wrong token; 403 no DUET_ADMIN_TOKEN set.
    """
    _check_token(settings, authorization)
    reloader: IndexReloader | None = getattr(request.app.state, "reloader", None)
    if reloader is None:
        raise NotReady("the model and index are still loading; retry in a moment")
    outcome = await reloader.reload(force=True)
    if outcome.result == "refused":
        raise IndexRefused(
            f"index {outcome.path} was refused: {outcome.reason}",
            version=outcome.version,
            path=outcome.path,
            at=outcome.at,
            serving=reloader.serving,
        )
    return JSONResponse(outcome.as_json())
