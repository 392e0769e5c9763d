"""The static sm_90 report (`lmloss.kernels.report`): how it reads SASS, on a hand-written listing, and the
report itself for a vocabulary of 50257 (GPT-2's, no multiple of 16: every row starts at another 16-byte
alignment) compiled ahead of time for an H100 without a GPU."""

from __future__ import annotations

import pytest

from lmloss.kernels.report import innermost_loops, main_loops, measure
from triton_support import compile_many_for_h100

# nvdisasm's layout: an outer loop around an inner one that streams with 16-byte accesses, a loop whose load
# is predicated (an edge block), and a loop with 8-byte loads.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_1:
        /*0020*/                   LDG.E.EL.128 R8, desc[UR4][R2.64] ;
        /*0030*/                   FADD R5, R8, R5 ;
        /*0040*/                   STG.E.EF.128 desc[UR4][R2.64], R8 ;
        /*0050*/              @P0 BRA `(.L_x_1) ;
        /*0060*/              @P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0070*/              @P2 LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*0080*/              @P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0090*/                   LDG.E.64 R8, desc[UR4][R2.64] ;
        /*00a0*/                   LDG.E.64 R10, desc[UR4][R2.64] ;
        /*00b0*/              @P0 BRA `(.L_x_3) ;
        /*00c0*/                   EXIT ;
"""


def test_sass_reading_finds_innermost_streaming_loops_and_their_access_widths():
    assert [len(body) for body in innermost_loops(SASS)] == [4, 2, 3]  # the outer loop is not innermost
    inner, eight_byte = main_loops(SASS)  # the predicated edge loop is not a main loop
    # 4 instructions for 16 bytes loaded per thread = 8 bf16 elements
    assert measure(inner, element_size=2) == (True, 4, 8.0)
    assert measure(eight_byte, element_size=2) == (False, 3, 8.0)


#: Issue #33's roles: the full KL's, the kept set's search and the invariant mode's kernels.
NEW_ROLES = ("backward_full_kl", "full_kl_sums", "top_k_histogram", "top_p_histogram", "top_p_candidates",
             "invariant_forward")  # fmt: skip


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_report_has_no_spills_16_byte_main_loops_and_the_new_kernels_within_their_budget(tmp_path):
    """Every kernel the ops launch (the full KL's, the kept set's search and the invariant mode's included), with
    every option on (temperature, softcap, entropy, smoothing, z-loss), compiles for sm_90 without spills at
    width 50257, and every main loop moves x (and the gradient) 16 bytes at a time; at default options on the last
    TP=8 shard of Qwen 2's padded vocabulary (18992 columns, 18699 of them vocabulary: a width no block divides),
    issue #33's loops issue no more instructions per element than an H100 issues while its memory moves the loop's
    bytes. One child process compiles both."""
    scripts = [  # two children compiling eight kernels each, at once
        "from lmloss.kernels.report import DEFAULT_ROLES, report\n"
        "import dataclasses\n"
        f"rows = {call}\n"
        "print(json.dumps([dict(dataclasses.asdict(r), within_budget=r.within_budget) for r in rows]))\n"
        for call in ("report((('50257', 50257, 50257),), DEFAULT_ROLES[:8], True)",
                     "report((('50257', 50257, 50257),), DEFAULT_ROLES[8:], True) + "
                     f"report((('tp8-last', 18992, 18699),), {NEW_ROLES!r}, False)")
    ]  # fmt: skip
    rows = [row for part in compile_many_for_h100(scripts, tmp_path) for row in part]
    every = [r for r in rows if r["vocab"] == "50257"]
    assert {(r["kernel"], r["role"]) for r in every} == {
        ("softmax_partials", "forward"),
        ("softmax_grad", "backward"),
        ("cross_entropy_loss_and_grad", "cross_entropy_pass1"),
        ("cross_entropy_loss_and_grad", "cross_entropy_pass2"),
        ("softmax_grad", "backward_full_kl"),
        ("difference_sums", "full_kl_sums"),
        ("search_histogram", "top_k_histogram"),
        ("search_histogram", "top_p_histogram"),
        ("search_candidates", "top_p_candidates"),
        ("block_partials", "invariant_forward"),
    }
    for r in every:
        assert r["spills"] == 0 and r["vectorized_main_loop"], r
        assert r["instructions_per_element"] > 0 and r["registers"] > 0, r
    new = [r for r in rows if r["vocab"] == "tp8-last"]
    assert sorted(r["role"] for r in new) == sorted(NEW_ROLES)
    for r in new:
        assert r["spills"] == 0 and r["vectorized_main_loop"] and r["within_budget"], r
        assert r["budget"] == pytest.approx(r["bytes_per_element"] * 132 * 4 * 32 * 1.7e9 / 3.0e12, abs=0.05), r
