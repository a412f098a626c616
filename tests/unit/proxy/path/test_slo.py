"""Per-request SLO headers: parsed in milliseconds, bounded, class defaults otherwise."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from fastroute.proxy.path.slo import MAX_SLO_MS, TPOT_SLO_HEADER, TTFT_SLO_HEADER, request_slos


def test_headers_override_the_class_defaults() -> None:
    assert request_slos(CIMultiDict(), 2.0, 0.1) == (2.0, 0.1)
    headers = CIMultiDict({"X-Fastroute-TTFT-SLO-ms": " 250 ", TPOT_SLO_HEADER: "12.5"})
    assert request_slos(headers, 2.0, 0.1) == (0.25, 0.0125)
    assert request_slos(CIMultiDict({TPOT_SLO_HEADER: "40"}), 2.0, 0.1) == (2.0, 0.04)


@pytest.mark.parametrize("bad", ["", "abc", "0", "0.5", "-3", "nan", "inf", str(MAX_SLO_MS * 2)])
def test_bad_values_name_the_header(bad: str) -> None:
    with pytest.raises(ValueError, match=TTFT_SLO_HEADER):
        request_slos(CIMultiDict({TTFT_SLO_HEADER: bad}), 2.0, 0.1)
