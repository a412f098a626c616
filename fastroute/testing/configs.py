"""fastroute configs for tests: the ``[[engines]]`` tables of a test fleet, whole stacks."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["engines_toml", "stack_toml"]


def engines_toml(
    urls: Sequence[str],
    model: str,
    *,
    names: Sequence[str] | None = None,
    capacity_rps: float | Sequence[float | str] = 10.0,
    regions: Sequence[str] | None = None,
    roles: Sequence[str] | None = None,
    hardware: str = "h100",
) -> str:
    """One ``[[engines]]`` table per URL, serving ``model`` on ``hardware``.

    Parameters
    ----------
    urls : sequence of str
        Engine roots, one engine each.
    model : str
    names : sequence of str, optional
        Engine names; default ``engine-0``, ``engine-1``, ...
    capacity_rps : float or sequence
        One capacity for all, or one per engine (a string is written as is, so tests can
        write invalid values).
    regions, roles : sequence of str, optional
        Per-engine ``region`` and ``role``; left out (the defaults) when None.
    hardware : str
    """
    n = len(urls)
    caps = [capacity_rps] * n if isinstance(capacity_rps, float | int) else list(capacity_rps)
    for what, values in (("names", names), ("capacity_rps", caps), ("regions", regions),
                         ("roles", roles)):  # fmt: skip
        if values is not None and len(values) != n:
            raise ValueError(f"{what} has {len(values)} entries for {n} engines")
    tables = []
    for i, url in enumerate(urls):
        name = f"engine-{i}" if names is None else names[i]
        lines = [f'name = "{name}"', f'url = "{url}"', f'models = ["{model}"]']
        if regions is not None:
            lines.append(f'region = "{regions[i]}"')
        if roles is not None:
            lines.append(f'role = "{roles[i]}"')
        lines += [f'hardware = "{hardware}"', f"capacity_rps = {caps[i]}"]
        tables.append("[[engines]]\n" + "\n".join(lines) + "\n\n")
    return "".join(tables)


def stack_toml(
    engines: str,
    *,
    tag: str,
    controller_port: int,
    period_s: float,
    solve_time_limit_s: float,
    proxy_port: int = 0,
    controller: str = "",
    proxy: str = "",
) -> str:
    """A whole config: ``engines`` (:func:`engines_toml`), a controller and a proxy sharing the
    table ``fastroute-test-TAG-weights`` (proxy stats ``fastroute-test-TAG-stats``).

    ``controller`` and ``proxy`` are added to those tables.
    """
    return (
        engines
        + f"[controller]\nport = {controller_port}\nperiod_s = {period_s}\n"
        + f"solve_time_limit_s = {solve_time_limit_s}\n{controller}\n"
        + f'[proxy]\nport = {proxy_port}\ntable_name = "fastroute-test-{tag}-weights"\n'
        + f'stats_name = "fastroute-test-{tag}-stats"\n{proxy}'
    )
