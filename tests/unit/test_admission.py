import pytest

from router.admission import AuthConfig, Authenticator, RateLimitConfig, RateLimiter

AUTH = Authenticator(AuthConfig(tokens={"cams": "t-cams", "ops": "t-ops"}, admin_clients=["ops"]))


@pytest.mark.parametrize(
    ("header", "admin", "status", "client"),
    [
        (None, False, 401, ""),
        ("", False, 401, ""),
        ("Basic dXNlcg==", False, 401, ""),
        ("Bearer ", False, 401, ""),
        ("Bearer nope", False, 403, ""),
        ("Bearer t-cams", False, 0, "cams"),
        ("bearer t-cams", False, 0, "cams"),
        ("Bearer t-cams", True, 403, ""),
        ("Bearer t-ops", True, 0, "ops"),
    ],
)
def test_bearer_tokens(header: str | None, admin: bool, status: int, client: str) -> None:
    v = AUTH.check(header, admin, "10.0.0.1")
    assert v.status == status
    if status == 0:
        assert v.client == client
    else:
        assert v.reason


def test_auth_off_admits_everyone_by_address() -> None:
    v = Authenticator(None).check(None, True, "127.0.0.9")
    assert v.status == 0 and v.client == "127.0.0.9"


def test_token_bucket_burst_then_rate() -> None:
    lim = RateLimiter(RateLimitConfig(rps=10, burst=3))
    t = 0.0
    assert [lim.admit("a", t).status for _ in range(4)] == [0, 0, 0, 429]
    refused = lim.admit("a", t)
    assert refused.retry_after_s >= 1 and "over 10 requests/s" in refused.reason
    assert lim.admit("b", t).status == 0, "buckets are per client"
    assert lim.admit("a", t + 100.0).status == 0  # one token back after 100 ms at 10/s
    assert lim.admit("a", t + 100.0).status == 429
    assert [lim.admit("a", t + 10_000.0).status for _ in range(4)] == [0, 0, 0, 429], "refill caps at burst"


def test_sustained_rate_is_enforced() -> None:
    lim = RateLimiter(RateLimitConfig(rps=50, burst=5))
    admitted = sum(1 for i in range(2000) if lim.admit("a", i * 1.0).status == 0)  # 1000 req/s for 2 s
    assert 100 <= admitted <= 106  # 50/s x 2 s + the burst


def test_no_limit_configured() -> None:
    assert RateLimiter(None).admit("a", 0).status == 0
