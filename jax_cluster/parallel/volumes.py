"""Inter-machine communication volumes: StreamFusion Appendix D, and counts from schedules.

All volumes are exact :class:`fractions.Fraction` s in units of X = B L H D / N elements, the
unit of Appendix D (X is the size of one of q, k, v, o held by one machine). Appendix D calls
its V "per GPU"; in that unit it is the number of elements a machine's GPUs send to other
machines together (= M x the per-GPU count). That is how :func:`counted_inter_volume` counts.

* :func:`paper_v_usp` -- Eq. 4 (P_r >= N) and Eq. 5 (P_r <= N), as printed.
* :func:`paper_v_sfu` -- Eq. 6 (P_u >= N) and Eq. 7 (P_u <= N), as printed.
* :func:`lemma_f`     -- V_diff = f(P_u) of Lemma D.1.
* :func:`counted_inter_volume` -- what a :class:`~.schedules.Schedule` sends across machines.
* :func:`physical_v_usp`, :func:`physical_v_sfu` -- closed forms of those counts.

The counts equal the printed formulas wherever the formulas describe a single layer of each
collective across machines: USP with P_u <= M (Eq. 4 for every P_r >= N) or P_u = N M;
StreamFusion with P_r <= M (Eq. 6 for every P_u >= N) or P_u = 1. In the mixed regimes they do
not: Eq. 5 counts USP's ring term with an extra factor N/P_r (as if each ring member sent the
KV of all heads), and Eq. 7 counts StreamFusion's Ulysses term with an extra factor N/P_u. The
physical counts still satisfy Lemma D.1's conclusion (V_USP >= V_SFU for 2 <= M <= P_u <= N).
"""
from __future__ import annotations

from fractions import Fraction

from .description import Schedule


def _pr(n: int, m: int, pu: int) -> Fraction:
    return Fraction(n * m, pu)


def paper_v_usp(n: int, m: int, pu: int) -> Fraction:
    """V_USP / (BLHD/N): Eq. 4 when P_r >= N, Eq. 5 when P_r <= N (P_r = N M / P_u)."""
    pr = _pr(n, m, pu)
    if pr >= n:
        return 2 * Fraction(n - 1)  # Eq. 4
    a = n / pr  # Ulysses degree across machines
    return 2 * (pr - 1) * a + 4 * (a - 1) / a  # Eq. 5


def paper_v_sfu(n: int, m: int, pu: int) -> Fraction:
    """V_SFU / (BLHD/N): Eq. 6 when P_u >= N, Eq. 7 when P_u <= N."""
    if pu >= n:
        return 4 * Fraction(n - 1, n)  # Eq. 6
    b = Fraction(n, pu)  # Ring degree across machines
    return 2 * (b - 1) + 4 * Fraction(pu - 1, pu) * b  # Eq. 7


def lemma_f(n: int, m: int, p) -> Fraction:
    """f(p) = 4N/p^2 - (4M + 6N)/p - 2p/M + 2N + 6 (Lemma D.1)."""
    p = Fraction(p)
    return 4 * n / p**2 - (4 * m + 6 * n) / p - 2 * p / m + 2 * n + 6


def physical_v_usp(n: int, m: int, pu: int) -> Fraction:
    """What the ``usp`` schedule sends across machines per machine, / (BLHD/N)."""
    pr = _pr(n, m, pu)
    if pu <= m:  # Ulysses inside a machine; two-level ring: N-1 shifts across machines
        return 2 * Fraction(n - 1)
    a = Fraction(pu, m)  # Ulysses spans a machines; all P_r ring members on other machines
    return 2 * (pr - 1) + 4 * (a - 1) / a


def physical_v_sfu(n: int, m: int, pu: int) -> Fraction:
    """What the ``tas`` / ``torus`` schedules send across machines per machine, / (BLHD/N)."""
    pr = _pr(n, m, pu)
    if pr <= m:  # ring inside a machine; Ulysses (Torus) across all N machines
        return 4 * Fraction(n - 1, n)
    b = pr / m  # ring spans b machines (b-1 outer shifts); every Ulysses peer on another machine
    return 2 * (b - 1) + 4 * Fraction(pu - 1, pu)


def counted_inter_volume(schedule: Schedule, per: str = "machine") -> Fraction:
    """Elements sent across machines, from the schedule's transfers, / (BLHD/N).

    ``per="machine"``: the most any machine's GPUs send together (Appendix D's V);
    ``per="gpu"``: the most any single GPU sends."""
    lay = schedule.layout
    sh = schedule.shape
    unit = Fraction(sh.batch * sh.seq_len * sh.heads * sh.head_dim, lay.machines)
    sent: dict[int, int] = {}
    for t in schedule.transfers():
        if t.link == "inter":
            key = lay.machine(t.src) if per == "machine" else t.src
            sent[key] = sent.get(key, 0) + t.bytes
    if not sent:
        return Fraction(0)
    return Fraction(max(sent.values()), sh.itemsize) / unit
