"""Properties of the wave-quantized resource model and the plan API (Python twin; the C++
solver is held to the twin in test_resource_solver.py).

Problems are (G, T_r, T_l, tau_ps, c_link_ps, c_cta_ps); see `resource.model`.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata
from megatron_overlap.resource import (
    DEFAULT_KERNEL_RESOURCES,
    DEFAULT_TILE,
    KernelResources,
    Plan,
    kernel_resources_from_compiled,
    plan_gemm2_gatherrs,
    solver,
)
from megatron_overlap.resource import model as twin
from megatron_overlap.resource.profile import (
    load_profile,
    profile_from_dict,
    save_profile,
)

H200 = load_profile("h200")
LIMITS = {k: getattr(H200.gpu, k) for k in H200.gpu.__dataclass_fields__ if k != "num_sms"}


def cdiv(a, b):
    return -(-a // b)


def best_end(p):
    return twin.solve(*p)[1]


# ---- wave quantization -------------------------------------------------------------------

@pytest.mark.parametrize("g", [7, 132])
def test_no_remote_gemm_time_steps_exactly_after_multiples_of_the_grid(g):
    tau = 1_000_003
    ends = [twin.solve(g, 0, t, tau, 50, 70) for t in range(1, 5 * g + 2)]
    assert all(k == 0 for k, _ in ends)
    for t in range(1, 5 * g + 1):  # t and t + 1 tiles
        same_wave = t % g != 0
        assert (ends[t][1] == ends[t - 1][1]) == same_wave, t
        if not same_wave:
            assert ends[t][1] - ends[t - 1][1] == tau  # one more wave, right after m * G


def test_compute_bound_best_time_is_whole_waves_of_all_tiles():
    # Link and per-CTA stores never bind (G * c_link <= tau, c_cta <= tau): the best split
    # finishes all T_r + T_l tiles in ceil((T_r + T_l) / G) waves, so the predicted time
    # is flat between multiples of G in the total and jumps right after.
    g, tau, tr = 66, 20_000_000, 150
    ends = [best_end((g, tr, tl, tau, 1000, 2_000_000)) for tl in range(4 * g)]
    for tl, e in enumerate(ends):
        assert e == cdiv(tr + tl, g) * tau, tl


def test_remote_tiles_at_link_speed_bound_the_time():
    g, tau = 132, 3_000_000
    for tr in (100, 1000, 5000):
        for c_link in (10_000, 100_000, 1_000_000):
            _, e = twin.solve(g, tr, 800, tau, c_link, 500_000)
            assert e >= tr * c_link  # the link moves every remote byte
            assert e >= cdiv(tr + 800, g) * tau  # and every tile takes a wave slot


# ---- monotonicity ------------------------------------------------------------------------

def random_problem(rng, link_bound: bool):
    g = int(rng.choice([16, 66, 132, 264]))
    tau = int(rng.integers(1_000_000, 130_000_000))
    hi = tau // g if not link_bound else 3 * tau
    return (g, int(rng.integers(1, 4000)), int(rng.integers(0, 4000)), tau,
            int(rng.integers(0, max(1, hi))), int(rng.integers(0, tau if not link_bound
                                                                 else 3 * tau)))


def test_more_remote_load_never_lowers_the_predicted_time():
    rng = np.random.default_rng(0)
    for _ in range(400):
        g, tr, tl, tau, c_link, c_cta = random_problem(rng, link_bound=bool(rng.random() < .5))
        base = best_end((g, tr, tl, tau, c_link, c_cta))
        more_tiles = best_end((g, tr + int(rng.integers(1, 60)), tl, tau, c_link, c_cta))
        f = float(rng.uniform(1, 3))  # more bytes per remote tile
        more_bytes = best_end((g, tr, tl, tau, int(c_link * f), int(c_cta * f)))
        assert more_tiles >= base and more_bytes >= base


def test_more_remote_tiles_never_lower_k_within_the_same_wave_count():
    # Compute-bound (the link and the per-CTA stores never bind): k is the fewest CTAs that
    # work off the remote queue within the grid's waves, k = ceil(T_r / waves), so more
    # remote tiles never lower it while the total stays within the same number of waves.
    # (Across a wave boundary, or where the link binds, the smallest k with the least time
    # can drop: docs/resource_model.md gives counterexamples.)
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(1500):
        g, tr, tl, tau, c_link, c_cta = random_problem(rng, link_bound=False)
        tr2 = tr + int(rng.integers(1, 200))
        waves, waves2 = cdiv(tr + tl, g), cdiv(tr2 + tl, g)
        if tl == 0 or waves != waves2 or cdiv(tr2, waves) > g - 1:
            continue  # (k <= G - 1: a grid too small for the remote queue is not this case)
        k, _ = twin.solve(g, tr, tl, tau, c_link, c_cta)
        k2, _ = twin.solve(g, tr2, tl, tau, c_link, c_cta)
        assert k2 >= k, (g, tr, tr2, tl)
        assert k == max(1, cdiv(tr, waves)) and k2 == max(1, cdiv(tr2, waves))
        checked += 1
    assert checked > 200


def test_slower_remote_tiles_never_lower_k_in_the_compute_bound_regime():
    # A slower per-CTA store (c_cta > tau) makes each remote tile cost more: more CTAs.
    g, tl, tau = 132, 2000, 10_000_000
    ks = [twin.solve(g, 1000, tl, tau, 0, c)[0] for c in range(0, 40_000_000, 2_000_000)]
    assert ks == sorted(ks) and ks[-1] > ks[0]


# ---- occupancy ---------------------------------------------------------------------------

def test_occupancy_follows_cuda_rules():
    ctas = lambda r, s, t: twin.ctas_per_sm(r, s, t, **LIMITS)
    assert ctas(255, 98304, 256) == 1  # registers: 8 warps x 8192 = the whole file
    assert ctas(128, 98304, 256) == 2  # 2 x (96 KiB + 1 KiB reserved) <= 228 KiB
    assert ctas(128, 120000, 256) == 1  # shared memory
    assert ctas(32, 0, 32) == 32  # the CTA limit
    assert ctas(32, 0, 1024) == 2  # threads
    assert ctas(33, 0, 1024) == 1  # 33 registers round up to 40 per thread per warp
    assert twin.ctas_per_sm(*DEFAULT_KERNEL_RESOURCES.__dict__.values(), **LIMITS) == 1


def test_kernel_resources_checks_and_compiled():
    with pytest.raises(TypeError):
        KernelResources(registers_per_thread=1.5, shared_bytes=0, threads_per_cta=32)
    with pytest.raises(ValueError):
        KernelResources(registers_per_thread=0, shared_bytes=0, threads_per_cta=32)

    class Meta:
        shared, num_warps = 65536, 4

    class Compiled:
        n_regs, metadata = 96, Meta()

    assert kernel_resources_from_compiled(Compiled()) == KernelResources(96, 65536, 128)
    with pytest.raises(ValueError, match="not a compiled Triton kernel"):
        kernel_resources_from_compiled(object())


# ---- plan API ----------------------------------------------------------------------------

def meta_of(counts, tp=1, ep=2, rank=0, num_tokens=4096):
    counts = np.asarray(counts, dtype=np.int64)
    z = np.zeros(tp * ep, dtype=np.int64)
    return GatherRSMetadata(tp_size=tp, tp_rank=rank % tp, ep_size=ep, ep_rank=rank // tp,
                            num_local_experts=counts.shape[0], num_tokens=num_tokens,
                            rows_per_expert_per_chunk=counts, send_slots=z, recv_slots=z,
                            dest_row_offsets=z, recv_rows_per_rank=z, gather_index=None,
                            recv_token_index=None)


SIZES = dict(num_sms=132, hidden=4096, ffn=14336)


def test_plan_model_no_remote_override_cpu_fixed():
    opts = GatherRSOptions()
    meta = meta_of([[1000, 1100], [900, 1200]])  # EP=2, rank 0: chunk 1 is remote
    plan = plan_gemm2_gatherrs(meta, opts, **SIZES)
    assert plan.source == "model" and plan.num_ctas == 132 and 1 <= plan.num_comm_ctas < 132
    b = plan.breakdown
    ncb = 4096 // DEFAULT_TILE[1]  # column blocks of H = 4096
    assert (b.remote_tiles, b.local_tiles) == ((9 + 10) * ncb, (8 + 8) * ncb)
    assert plan.predicted_us == pytest.approx(
        b.gemm_us + b.store_latency_us + b.finalize_us + b.launch_us)
    assert b.gemm_us == max(b.remote_bound_us, b.wave_bound_us)

    world1 = plan_gemm2_gatherrs(meta_of([[1000], [900]], ep=1), opts, **SIZES)
    assert (world1.num_comm_ctas, world1.source) == (0, "no-remote")
    assert world1.breakdown.remote_tiles == 0 and world1.breakdown.store_latency_us == 0
    empty_remote = plan_gemm2_gatherrs(meta_of([[1000, 0], [900, 0]]), opts, **SIZES)
    assert (empty_remote.num_comm_ctas, empty_remote.source) == (0, "no-remote")

    forced = plan_gemm2_gatherrs(meta, GatherRSOptions(num_comm_ctas=7), **SIZES)
    assert (forced.num_comm_ctas, forced.source) == (7, "override")
    assert forced.predicted_us >= plan.predicted_us  # the model's choice is its best
    with pytest.raises(ValueError, match="exceeds the GPU's 132 SMs"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(num_comm_ctas=133), **SIZES)

    cpu = plan_gemm2_gatherrs(meta, opts)
    assert (cpu.num_ctas, cpu.source, cpu.predicted_us) == (None, "cpu", None)
    assert Plan(num_comm_ctas=1, num_ctas=1, source="test").breakdown is None

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        fixed = plan_gemm2_gatherrs(meta, opts, num_sms=132)
    assert fixed.source == "fixed" and fixed.num_ctas == 132


def test_plan_static_inputs_cache_follows_the_environment(monkeypatch, tmp_path):
    """The plan caches what depends only on the solver, the profile and the kernel; the
    variables that pick them are read on every call, so changing one takes effect (and a
    bad value still raises, naming the variable)."""
    import dataclasses

    from megatron_overlap.resource.profile import save_profile

    meta = meta_of([[1000, 1100], [900, 1200]])
    monkeypatch.delenv("MEGATRON_OVERLAP_HW_PROFILE", raising=False)
    base = plan_gemm2_gatherrs(meta, GatherRSOptions(), **SIZES)
    assert plan_gemm2_gatherrs(meta, GatherRSOptions(), **SIZES) == base
    prof = load_profile("h200")
    slow = dataclasses.replace(prof, name="slow-link", link_bandwidth_gbps=5.0,
                               cta_bandwidth_gbps=0.5)
    save_profile(slow, tmp_path / "slow.yaml")
    monkeypatch.setenv("MEGATRON_OVERLAP_HW_PROFILE", str(tmp_path / "slow.yaml"))
    changed = plan_gemm2_gatherrs(meta, GatherRSOptions(), **SIZES)
    assert changed.predicted_us > base.predicted_us
    assert changed == plan_gemm2_gatherrs(meta, GatherRSOptions(), profile=slow, **SIZES)
    monkeypatch.setenv("MEGATRON_OVERLAP_SOLVER", "bogus")
    with pytest.raises(ValueError, match="MEGATRON_OVERLAP_SOLVER='bogus'"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), **SIZES)


def test_plan_with_two_ctas_per_sm_doubles_the_grid():
    meta = meta_of([[1000, 1100], [900, 1200]])
    plan = plan_gemm2_gatherrs(meta, GatherRSOptions(), kernel=KernelResources(128, 98304, 256),
                               **SIZES)
    assert plan.num_ctas == 264 and plan.breakdown.ctas_per_sm == 2
    # tau was calibrated at 1 CTA per SM: with 2 resident, each tile takes twice as long
    one = plan_gemm2_gatherrs(meta, GatherRSOptions(), **SIZES)
    assert plan.breakdown.tile_us == pytest.approx(2 * one.breakdown.tile_us, abs=1e-6)


def test_plan_bad_input():
    meta = meta_of([[10, 10]])
    with pytest.raises(ValueError, match="hidden=0"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), num_sms=132, hidden=0, ffn=64)
    with pytest.raises(ValueError, match="elem_bytes=3"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), num_sms=132, hidden=64, ffn=64,
                            elem_bytes=3)
    with pytest.raises(TypeError):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), num_sms=132.0, hidden=64, ffn=64)
    with pytest.raises(ValueError, match="no tile time for tile 64x64x32"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), tile=(64, 64, 32), **SIZES)
    with pytest.raises(ValueError, match="cannot be resident"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), kernel=KernelResources(255, 0, 1024),
                            **SIZES)
    with pytest.raises(ValueError, match="at least 2 CTAs"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), num_sms=1, hidden=64, ffn=64)
    # numpy ints are ints; a bad size is refused also where the plan would not use it;
    # a non-int recv_rows is a TypeError; a bad solver argument is named as the argument.
    import numpy as np

    plan = plan_gemm2_gatherrs(meta, GatherRSOptions(), num_sms=np.int64(132),
                               hidden=np.int64(64), ffn=np.int32(64))
    assert plan.num_ctas is not None
    with pytest.raises(ValueError, match="hidden=-3"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), num_sms=132, hidden=-3)
    with pytest.raises(TypeError, match="recv_rows=1.5"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), recv_rows=1.5, **SIZES)
    with pytest.raises(ValueError, match="solver='zz'"):
        plan_gemm2_gatherrs(meta, GatherRSOptions(), solver="zz", **SIZES)


def test_default_tile_is_the_kernels():
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as KERNEL_TILE

    assert DEFAULT_TILE == (KERNEL_TILE.bm, KERNEL_TILE.bn, KERNEL_TILE.bk)
    H200.tile_time(*DEFAULT_TILE)  # the shipped profile covers it


def test_twin_stands_in_with_one_warning(monkeypatch):
    monkeypatch.setattr(solver, "_cpp", None)
    monkeypatch.setattr(solver, "_warned", False)
    monkeypatch.delenv(solver.SOLVER_ENV, raising=False)
    with pytest.warns(UserWarning, match="not built"):
        assert solver.implementation() is twin
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert solver.implementation() is twin  # once only
        plan = plan_gemm2_gatherrs(meta_of([[1000, 1100]]), GatherRSOptions(), **SIZES)
    assert plan.source == "model"
    with pytest.raises(ImportError, match="not built"):
        solver.implementation("cpp")
    with pytest.raises(ValueError, match="expected 'cpp' or 'python'"):
        solver.implementation("fortran")


# ---- profiles ----------------------------------------------------------------------------

def test_shipped_profile_and_round_trip(tmp_path):
    assert H200.gpu.num_sms == 132 and not H200.provisional  # calibrated on 2x H200
    assert H200.source.startswith("launch/calibrate.py")
    path = tmp_path / "x.yaml"
    save_profile(H200, path, header="test header")
    assert path.read_text().startswith("# test header")
    assert load_profile(path) == H200


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend torch sees one CUDA device of the given name (`fake_gpu(name)`); the
    per-process caches of the device's profile are emptied before and after."""
    import torch

    from megatron_overlap.resource import profile as prof_mod

    def install(name):
        prof_mod._current_device_profile.cache_clear()
        prof_mod._warned_unknown_gpu.clear()
        prof_mod._BY_NAME.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)

    monkeypatch.delenv("MEGATRON_OVERLAP_HW_PROFILE", raising=False)
    yield install
    prof_mod._current_device_profile.cache_clear()
    prof_mod._warned_unknown_gpu.clear()
    prof_mod._BY_NAME.clear()


def test_every_device_entry_names_a_shipped_profile():
    from megatron_overlap.resource.profile import DEVICE_PROFILES, device_profile_name

    for _, name in DEVICE_PROFILES:
        prof = load_profile(name)
        assert prof.name == name and prof.source.startswith("launch/calibrate.py")
        assert not prof.provisional and any(t.tma_store for t in prof.tile_times)
    assert device_profile_name("NVIDIA H100 80GB HBM3") == "h100"  # torch's name of the SXM
    assert device_profile_name("NVIDIA H200") == "h200"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "",
                  "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                  "H200", "H100 80GB HBM3"):
        assert device_profile_name(other) is None
    with pytest.raises(TypeError, match="device_name=0: expected a str"):
        device_profile_name(0)


@pytest.mark.parametrize("gpu, expected, warns", [
    ("NVIDIA H100 80GB HBM3", "h100", False),
    ("NVIDIA H200", "h200", False),
    ("NVIDIA A100-SXM4-80GB", "h200", True),
])
def test_default_profile_follows_the_gpu(fake_gpu, monkeypatch, gpu, expected, warns):
    """Without MEGATRON_OVERLAP_HW_PROFILE the planner loads the current GPU's shipped
    profile; a GPU with none gets the default profile and one warning naming the GPU; the
    variable wins over the device."""
    from megatron_overlap import config
    from megatron_overlap.resource.profile import default_profile_name

    fake_gpu(gpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert default_profile_name() == expected
        assert load_profile().name == expected
        assert default_profile_name() == expected  # cached: no second warning
    mine = [w for w in caught if "no hardware profile for GPU" in str(w.message)]
    assert len(mine) == (1 if warns else 0)
    if warns:
        assert repr(gpu) in str(mine[0].message) and "launch/calibrate.py" in str(mine[0].message)
    assert config.fused_path_settings(1)["hw_profile"] == expected
    assert config.fused_path_settings(1, triton_gpu=False)["hw_profile"] == ""
    monkeypatch.setenv("MEGATRON_OVERLAP_HW_PROFILE", "h100" if expected == "h200" else "h200")
    assert load_profile().name != expected


def test_no_cuda_means_the_default_profile(monkeypatch):
    import torch

    from megatron_overlap.resource.profile import DEFAULT_PROFILE, default_profile_name

    monkeypatch.delenv("MEGATRON_OVERLAP_HW_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_profile_name() == DEFAULT_PROFILE == "h200"


def test_bad_profiles_name_the_key():
    good = H200.to_dict()
    with pytest.raises(ValueError, match="missing keys \\['hbm_bandwidth_gbps'\\]"):
        profile_from_dict({k: v for k, v in good.items() if k != "hbm_bandwidth_gbps"})
    with pytest.raises(ValueError, match="link_bandwidth_gbps=-1"):
        profile_from_dict(dict(good, link_bandwidth_gbps=-1))
    with pytest.raises(ValueError, match="gpu.num_sms=0"):
        profile_from_dict(dict(good, gpu=dict(good["gpu"], num_sms=0)))
    gpu = {k: v for k, v in good["gpu"].items() if k != "num_sms"}
    with pytest.raises(ValueError, match="gpu: missing keys \\['num_sms'\\], unknown keys "
                                         "\\['sms'\\]"):
        profile_from_dict(dict(good, gpu=dict(gpu, sms=132)))
    tile = {k: v for k, v in good["tile_times"][0].items() if k != "beta_us"}
    with pytest.raises(ValueError, match="missing keys \\['beta_us'\\], unknown keys \\[\\]"):
        profile_from_dict(dict(good, tile_times=[tile]))
    with pytest.raises(ValueError, match="unknown; expected one of"):
        load_profile("no-such-gpu")


def test_tma_store_tile_times_are_looked_up_by_epilogue():
    good = H200.to_dict()
    reg = next(t for t in good["tile_times"] if "tma_store" not in t)  # written without the key
    tma = next(t for t in good["tile_times"] if t.get("tma_store") is True)  # shipped (v5.3)
    prof = profile_from_dict(dict(good, tile_times=[reg, tma]))
    assert prof.tile_time(*DEFAULT_TILE).tma_store is False
    got = prof.tile_time(*DEFAULT_TILE, tma_store=True)
    assert got.tma_store and (got.alpha_us, got.beta_us) == (tma["alpha_us"], tma["beta_us"])
    with pytest.raises(ValueError, match="appears twice with the same tma_store"):
        profile_from_dict(dict(good, tile_times=[reg, dict(reg)]))
    with pytest.raises(ValueError, match="tile_times.tma_store='yes'"):
        profile_from_dict(dict(good, tile_times=[reg, dict(tma, tma_store="yes")]))
    with pytest.raises(ValueError, match="optionally tma_store"):
        profile_from_dict(dict(good, tile_times=[dict(reg, epilogue="tma")]))
    # a profile without a TMA-store entry: its register-store time, warned once
    only_reg = profile_from_dict(dict(good, name="only-reg", tile_times=[reg]))
    with pytest.warns(UserWarning, match="no TMA-store tile time for 128x256x64"):
        assert only_reg.tile_time(*DEFAULT_TILE, tma_store=True) == only_reg.tile_time(
            *DEFAULT_TILE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        only_reg.tile_time(*DEFAULT_TILE, tma_store=True)
    with pytest.raises(ValueError, match="no tile time for tile 64x64x32"):
        only_reg.tile_time(64, 64, 32, tma_store=True)  # no shape at all: still an error
    for bad in ("yes", None, 1):
        with pytest.raises(TypeError, match="tma_store=.*expected a bool"):
            H200.tile_time(*DEFAULT_TILE, tma_store=bad)
    with pytest.raises(ValueError, match="has a tma_store entry but no register-store one"):
        profile_from_dict(dict(good, tile_times=[tma]))


def test_plan_takes_the_tile_time_of_its_epilogue():
    meta = meta_of([[1000, 1100], [900, 1200]])
    ffn = SIZES["ffn"]
    for tma in (False, True):
        t = H200.tile_time(*DEFAULT_TILE, tma_store=tma)
        plan = plan_gemm2_gatherrs(meta, GatherRSOptions(), tma_store=tma, **SIZES)
        assert plan.breakdown.tile_us == pytest.approx(
            t.alpha_us + t.beta_us * cdiv(ffn, DEFAULT_TILE[2]), abs=1e-5)
    assert (H200.tile_time(*DEFAULT_TILE, tma_store=True)
            != H200.tile_time(*DEFAULT_TILE))  # so the loop above tells them apart
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="tma_store=.*expected a bool"):
            plan_gemm2_gatherrs(meta, GatherRSOptions(), tma_store=bad, **SIZES)


def test_epilogue_stores_tma_follows_the_tile_and_row_size():
    from megatron_overlap.ops.triton_gemm2_gatherrs import (
        DEFAULT_TILE as REGISTER_TILE,
        DEFAULT_TMA_TILE,
        epilogue_stores_tma,
    )

    assert epilogue_stores_tma(DEFAULT_TMA_TILE, 2048, 2)
    assert not epilogue_stores_tma(DEFAULT_TMA_TILE, 1004, 2)  # 2008-byte rows: registers
    assert not epilogue_stores_tma(REGISTER_TILE, 2048, 2)


def test_prereduce_host_term_is_optional_and_checked():
    good = H200.to_dict()
    assert good["prereduce_host_us"] == H200.prereduce_host_us > 0  # shipped, round-trips
    older = {k: v for k, v in good.items() if k != "prereduce_host_us"}  # a pre-v4.6 file
    assert profile_from_dict(older).prereduce_host_us == 0.0
    for bad in (-1.0, float("nan"), "600"):
        with pytest.raises(ValueError, match="prereduce_host_us"):
            profile_from_dict(dict(good, prereduce_host_us=bad))
    with pytest.raises(ValueError, match="YAML reads a number like 6e2 as text"):
        profile_from_dict(dict(good, prereduce_host_us="6e2"))


def test_profile_files_name_what_is_wrong(tmp_path, monkeypatch):
    import yaml

    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes([0xFB, 0xFF, 0x00, 0x12]))
    with pytest.raises(ValueError, match="binary.yaml: not a valid YAML text file"):
        load_profile(binary)
    with pytest.raises(ValueError, match="is a directory"):
        load_profile(tmp_path)
    monkeypatch.setenv("MEGATRON_OVERLAP_HW_PROFILE", "no-such-gpu")
    with pytest.raises(ValueError, match="MEGATRON_OVERLAP_HW_PROFILE='no-such-gpu': "
                                         "hardware profile 'no-such-gpu': unknown"):
        load_profile()
    older = H200.to_dict()
    del older["prereduce_host_us"]  # a profile written before v4.6: loads, with a warning
    path = tmp_path / "older.yaml"
    path.write_text(yaml.safe_dump(older))
    with pytest.warns(UserWarning, match="has no prereduce_host_us"):
        assert load_profile(path).prereduce_host_us == 0.0
