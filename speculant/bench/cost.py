"""What a million generated tokens cost on a machine rented by the hour, plain and speculating.

A machine decoding at R tokens/s makes a million tokens in 1e6 / R seconds, so at P dollars an hour they
cost P / 3600 · 1e6 / R. The bench's rates count the whole request (prompt prefill and first token
included), so the cost is what the machine is billed while it writes them; speculation lowers it by the
ratio of the rates.
"""

from __future__ import annotations

# The on-demand price of a cloud VM of the size this project measures on (2 vCPUs, x86-64, compute-optimized:
# AWS c7a.large, AMD EPYC, is about $0.10 an hour in us-east-1, 2026). Pass --price-per-hour for yours.
DEFAULT_PRICE_PER_HOUR = 0.10
PRICE_HELP = (f"machine price in dollars per hour for the cost per million generated tokens (default "
              f"{DEFAULT_PRICE_PER_HOUR:g}: a 2-vCPU cloud VM on demand, e.g. AWS c7a.large)")


def usd_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """Dollars per million tokens made at tokens_per_s on a machine billed price_per_hour."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    return price_per_hour / 3600 * 1e6 / tokens_per_s


def saving(plain_usd: float, speculating_usd: float) -> float:
    """The share of the plain cost speculation saves (negative: it costs more)."""
    return 1 - speculating_usd / plain_usd


def cost_line(price_per_hour: float, plain_tps: float, others: list[tuple[str, float]], where: str) -> str:
    """One line: plain decoding's cost per million tokens, then each configuration's with its saving."""
    plain = usd_per_million(plain_tps, price_per_hour)
    parts = [f"plain ${plain:.3f}"]
    for name, tps in others:
        usd = usd_per_million(tps, price_per_hour)
        parts.append(f"{name} ${usd:.3f} ({-100 * saving(plain, usd):+.0f}%)")
    return f"cost per million generated tokens at ${price_per_hour:g}/hour, {where}: " + ", ".join(parts)
