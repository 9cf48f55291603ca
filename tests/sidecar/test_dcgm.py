"""The DCGM source: hand-written dcgm-exporter scrapes, a real HTTP server on loopback, and grammar-driven fuzzing."""

from __future__ import annotations

import contextlib
import gzip
import math
import socket
import socketserver
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope_sidecar.metrics import BY_NAME
from meshscope_sidecar.sources.dcgm import DcgmSource, fetch, is_blank, parse_exposition
from meshscope_sidecar.sources.dcgm import ScrapeError as DcgmScrapeError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

DATA = Path(__file__).resolve().parents[1] / "data" / "sidecar" / "dcgm"
MIB = 2**20


def read(name: str) -> str:
    return (DATA / name).read_text()


def by_key(samples: object) -> dict[tuple[str, int | None, str], float]:
    """(metric, gpu, gpu_instance) -> value; fails on a duplicate key."""
    out: dict[tuple[str, int | None, str], float] = {}
    for sample in samples:  # type: ignore[attr-defined]
        key = (sample.metric, sample.gpu, dict(sample.labels)["gpu_instance"])
        assert key not in out, f"duplicate series {key}"
        out[key] = sample.value
    return out


def ingested(name: str, **kwargs: object) -> DcgmSource:
    source = DcgmSource(**kwargs)  # type: ignore[arg-type]
    source.ingest(read(name))
    return source


# --- the scrapes -------------------------------------------------------------------------------------------------


def test_h100_default_counters_convert_to_base_units() -> None:
    values = by_key(ingested("h100_8gpu_default.prom").samples())
    assert values["meshscope_gpu_utilization_ratio", 5, ""] == pytest.approx(0.37)
    assert values["meshscope_gpu_utilization_ratio", 0, ""] == pytest.approx(1.0)
    assert values["meshscope_gpu_sm_clock_hertz", 3, ""] == pytest.approx(1.755e9)
    assert values["meshscope_gpu_sm_clock_hertz", 0, ""] == pytest.approx(1.98e9)
    assert values["meshscope_gpu_temperature_celsius", 4, ""] == 44
    assert values["meshscope_gpu_power_watts", 2, ""] == pytest.approx(400.0)
    # used 60000 + 1000*2 MiB; total = used + free + reserved = 81559 MiB on every GPU
    assert values["meshscope_gpu_memory_used_bytes", 2, ""] == 62000 * MIB
    for gpu in range(8):
        assert values["meshscope_gpu_memory_total_bytes", gpu, ""] == 81559 * MIB
    assert values["meshscope_gpu_tensor_active_ratio", 5, ""] == pytest.approx(0.12)
    assert values["meshscope_gpu_engine_active_ratio", 7, ""] == pytest.approx(0.97)
    assert values["meshscope_gpu_dram_active_ratio", 1, ""] == pytest.approx(0.35)
    assert values["meshscope_gpu_pcie_transmit_bytes_per_second", 7, ""] == 8_000_000
    assert values["meshscope_gpu_pcie_receive_bytes_per_second", 0, ""] == 2_000_000
    # not in the default counters: absent, not 0
    assert not any(
        m in {"meshscope_gpu_sm_active_ratio", "meshscope_gpu_nvlink_transmit_bytes_per_second"} for m, *_ in values
    )
    # XID 13 on GPU 6 predates the sidecar: nothing counted yet, but every GPU has its counter
    assert {g: values["meshscope_gpu_xid_errors_total", g, ""] for g in range(8)} == dict.fromkeys(range(8), 0.0)
    # per GPU, 13 mapped fields give 11 gauges (FB_FREE, FB_USED, FB_RESERVED give used and total; XID is a counter)
    # and 1 XID counter
    assert len(values) == 8 * 12


def test_every_sample_names_a_listed_metric_with_its_labels() -> None:
    for name in ("h100_8gpu_default.prom", "dcgm46_h200_2gpu.prom", "a100_mig.prom", "sentinels_and_junk.prom"):
        for sample in ingested(name).samples():
            spec = BY_NAME[sample.metric]
            assert spec.source in {"dcgm", "dcgm|nvml"}
            assert tuple(label for label, _ in sample.labels) == spec.labels


def test_h100_devices_keep_uuid_pci_bus_id_and_pod_from_mixed_label_sets() -> None:
    devices = ingested("h100_8gpu_default.prom").devices()
    assert [d.index for d in devices] == list(range(8))
    gpu2 = devices[2]
    assert gpu2.uuid == "GPU-5f3c1a2e-9b7d-4e61-a0c8-0002d3e1f702"
    assert gpu2.pci_bus_id == "0000:3a:00.0"
    assert gpu2.model == "NVIDIA H100 80GB HBM3"
    assert gpu2.mig_instance is None
    assert [d.pod for d in devices] == ["llama-train-0"] * 4 + [""] * 4
    assert devices[0].namespace == "training"


def test_dcgm_46_names_and_lower_case_labels_read_like_the_old_ones() -> None:
    source = ingested("dcgm46_h200_2gpu.prom", hostname="h200-node-2")
    values = by_key(source.samples())
    assert values["meshscope_gpu_utilization_ratio", 0, ""] == pytest.approx(0.85)  # int64 percent under the new name
    assert values["meshscope_gpu_sm_active_ratio", 0, ""] == pytest.approx(0.64)
    assert values["meshscope_gpu_sm_active_ratio", 1, ""] == pytest.approx(0.25)
    assert values["meshscope_gpu_tensor_active_ratio", 0, ""] == pytest.approx(0.38)
    assert values["meshscope_gpu_dram_active_ratio", 1, ""] == pytest.approx(0.70)  # no HELP, no TYPE
    assert values["meshscope_gpu_engine_active_ratio", 1, ""] == pytest.approx(0.99)
    assert values["meshscope_gpu_power_watts", 0, ""] == pytest.approx(512.25)
    assert values["meshscope_gpu_temperature_celsius", 1, ""] == 61
    assert values["meshscope_gpu_memory_total_bytes", 0, ""] == 143771 * MIB  # FB_TOTAL itself
    assert values["meshscope_gpu_memory_used_bytes", 1, ""] == 131072 * MIB
    assert values["meshscope_gpu_nvlink_transmit_bytes_per_second", 0, ""] == 150e9
    assert values["meshscope_gpu_nvlink_receive_bytes_per_second", 1, ""] == 91e9
    assert values["meshscope_gpu_pcie_transmit_bytes_per_second", 0, ""] == 52_428_800  # typed counter, still a rate
    assert [d.uuid for d in source.devices()] == [
        "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
        "GPU-1a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    ]
    assert source.last_stats.unknown_fields == 2  # PCIE_REPLAY_TOTAL on both GPUs


@pytest.mark.parametrize(
    ("hostname", "kept"),
    [("h200-node-2", True), ("H200-NODE-2.cluster.local", True), ("h200-node-3", False), (None, True)],
    ids=["same", "fqdn-and-case", "other-node", "no-filter"],
)
def test_hostname_filter(hostname: str | None, kept: bool) -> None:
    source = ingested("dcgm46_h200_2gpu.prom", hostname=hostname)
    gauges = [s for s in source.samples() if s.metric != "meshscope_gpu_xid_errors_total"]
    assert bool(gauges) is kept
    # 16 fields x 2 GPUs, of which PCIE_REPLAY_TOTAL is not mapped: 30 series name the other node
    assert source.last_stats.other_node == (0 if kept else 30)


def test_old_hostname_spelling_is_filtered_too() -> None:
    assert ingested("h100_8gpu_default.prom", hostname="gpu-node-08").last_stats.other_node == 8 * 13
    assert ingested("h100_8gpu_default.prom", hostname="gpu-node-07").last_stats.other_node == 0


def test_pod_gpu_set_by_index_and_uuid() -> None:
    source = ingested("h100_8gpu_default.prom", gpus={1, "gpu-5f3c1a2e-9b7d-4e61-a0c8-0002d3e1f702"})
    assert {s.gpu for s in source.samples()} == {1, 2}
    assert source.last_stats.other_gpus == 6 * 13
    assert [d.index for d in source.devices()] == [1, 2]


def test_mig_has_no_utilisation_but_per_instance_memory_and_activity() -> None:
    source = ingested("a100_mig.prom")
    values = by_key(source.samples())
    # GPU_UTIL reads 0 on the instances (dcgm-exporter#216): no utilisation for GPU 0 at all, not 0
    assert [k for k in values if k[0] == "meshscope_gpu_utilization_ratio"] == [
        ("meshscope_gpu_utilization_ratio", 1, "")
    ]
    assert values["meshscope_gpu_utilization_ratio", 1, ""] == pytest.approx(0.55)
    assert values["meshscope_gpu_memory_total_bytes", 0, "1"] == (20000 + 20480 + 0) * MIB
    assert values["meshscope_gpu_memory_used_bytes", 0, "2"] == 480 * MIB
    assert values["meshscope_gpu_memory_total_bytes", 1, ""] == (1000 + 79500 + 580) * MIB
    assert values["meshscope_gpu_engine_active_ratio", 0, "2"] == 0.0  # a real idle instance is a real 0
    assert values["meshscope_gpu_engine_active_ratio", 0, "1"] == pytest.approx(0.73)
    assert any("GPU 0 is in MIG mode" in note for note in source.notes())
    devices = source.devices()
    assert [(d.index, d.mig_instance, d.mig_profile, d.pod) for d in devices] == [
        (0, 1, "3g.40gb", "llm-infer-0"),
        (0, 2, "3g.40gb", ""),
        (1, None, "", "bert-train-0"),
    ]


def test_sentinels_are_missing_and_junk_lines_cost_one_line_each() -> None:
    source = ingested("sentinels_and_junk.prom")
    values = by_key(source.samples())
    stats = source.last_stats
    assert stats.junk_lines == 7
    assert stats.bad_series == 2  # gpu="x" and no gpu label
    assert stats.blank_values == 5  # int64, fp64 and int32 blanks, NaN, +Inf
    assert source.health.parse_errors_total == 9
    assert source.health.up
    assert "GPU-unterminated" in (source.health.last_error or "")
    assert ("meshscope_gpu_temperature_celsius", 0, "") not in values
    assert ("meshscope_gpu_power_watts", 0, "") not in values
    assert ("meshscope_gpu_sm_clock_hertz", 0, "") not in values
    assert values["meshscope_gpu_temperature_celsius", 1, ""] == 47
    assert values["meshscope_gpu_power_watts", 1, ""] == pytest.approx(250.5)
    assert values["meshscope_gpu_sm_clock_hertz", 1, ""] == pytest.approx(1.095e9)  # the timestamp is not the value
    assert values["meshscope_gpu_utilization_ratio", 0, ""] == pytest.approx(0.12)
    assert values["meshscope_gpu_utilization_ratio", 1, ""] == pytest.approx(0.88)  # trailing comma is valid
    assert ("meshscope_gpu_memory_used_bytes", 1, "") not in values
    assert source.devices()[0].pod == 'a "quoted" pod, with {braces}'
    assert source.devices()[0].namespace == "ns\\back"


@pytest.mark.parametrize(
    ("text", "blank"),
    [
        ("9223372036854775792", True),
        ("9223372036854775795", True),
        ("9.223372036854776e+18", True),
        ("2147483632", True),
        ("2147483635", True),
        ("2147483636", False),
        ("140737488355328.000000", True),
        ("140737488355331.000000", True),
        ("140737488355332.000000", False),
        ("NaN", True),
        ("0", False),
        ("81559", False),
    ],
)
def test_blank_sentinels(text: str, blank: bool) -> None:
    assert is_blank(float(text), text) is blank


def test_gpu_util_ratio_written_as_a_double_is_already_a_ratio() -> None:
    text = 'DCGM_FI_DEV_GPU_UTIL_RATIO{gpu="0",uuid="GPU-x"} 0.420000\nDCGM_FI_DEV_GPU_UTIL_RATIO{gpu="1",uuid="GPU-y"} 42\n'
    source = DcgmSource()
    source.ingest(text)
    values = by_key(source.samples())
    assert values["meshscope_gpu_utilization_ratio", 0, ""] == pytest.approx(0.42)
    assert values["meshscope_gpu_utilization_ratio", 1, ""] == pytest.approx(0.42)


def test_memory_total_needs_reserved_when_total_is_not_exported() -> None:
    source = DcgmSource()
    source.ingest('DCGM_FI_DEV_FB_USED{gpu="0"} 100\nDCGM_FI_DEV_FB_FREE{gpu="0"} 900\n')
    values = by_key(source.samples())
    assert values["meshscope_gpu_memory_used_bytes", 0, ""] == 100 * MIB
    assert ("meshscope_gpu_memory_total_bytes", 0, "") not in values
    assert any("no memory total" in note for note in source.notes())


def test_nvlink_link_series_are_not_per_gpu_values() -> None:
    source = DcgmSource()
    source.ingest(
        'DCGM_FI_PROF_NVLINK_TX_BYTES{nvlink="0",gpu="0",gpu_uuid="GPU-x"} 5\n'
        'DCGM_FI_PROF_NVLINK_TX_BYTES{gpu="0",UUID="GPU-x"} 7\n'
    )
    assert by_key(source.samples())["meshscope_gpu_nvlink_transmit_bytes_per_second", 0, ""] == 7


def _with_xid(codes: dict[int, int]) -> str:
    lines = []
    for line in read("h100_8gpu_default.prom").splitlines():
        if line.startswith("DCGM_FI_DEV_XID_ERRORS{"):
            gpu = int(line.split('gpu="', 1)[1].split('"', 1)[0])
            lines.append(line.rsplit(" ", 1)[0] + f" {codes[gpu]}" if gpu in codes else line)
        else:
            lines.append(line)
    return "\n".join(lines)


def test_xid_counts_changes_of_the_last_code_not_its_value() -> None:
    source = DcgmSource()
    source.ingest(_with_xid({}))  # GPU 6 already shows 13: before our time
    steps = [({1: 79}, 1), ({1: 79}, 1), ({1: 0}, 1), ({1: 48}, 2), ({1: 79}, 3)]
    for codes, expected_gpu1 in steps:
        source.ingest(_with_xid(codes))
        values = by_key(source.samples())
        assert values["meshscope_gpu_xid_errors_total", 1, ""] == expected_gpu1
        assert values["meshscope_gpu_xid_errors_total", 6, ""] == 0


# --- over HTTP ---------------------------------------------------------------------------------------------------


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextlib.contextmanager
def serve(answer: Callable[[socket.socket, threading.Event], None]) -> Iterator[tuple[str, threading.Event]]:
    """A loopback TCP server that reads one request head per connection, then lets ``answer`` write anything."""
    released = threading.Event()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            data = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                answer(self.request, released)

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", released
    finally:
        released.set()
        server.shutdown()
        server.server_close()
        thread.join()


def reply(
    body: bytes, head: str = "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
) -> Callable[..., None]:
    def answer(sock: socket.socket, _released: threading.Event) -> None:
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)

    return answer


def test_scrape_over_http() -> None:
    with serve(reply(read("h100_8gpu_default.prom").encode())) as (url, _):
        source = DcgmSource(url=url, timeout_seconds=5.0)
        source.poll()
    assert source.health.up
    assert source.health.last_error is None
    assert by_key(source.samples())["meshscope_gpu_utilization_ratio", 5, ""] == pytest.approx(0.37)
    assert not math.isnan(source.health.last_success_unix_s)


def test_chunked_and_gzip_answers() -> None:
    body = gzip.compress(read("dcgm46_h200_2gpu.prom").encode())

    def answer(sock: socket.socket, _released: threading.Event) -> None:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n"
        pieces = [body[i : i + 1000] for i in range(0, len(body), 1000)]
        sock.sendall(head + b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in pieces) + b"0\r\n\r\n")

    with serve(answer) as (url, _):
        source = DcgmSource(url=url, timeout_seconds=5.0)
        source.poll()
    assert source.health.up, source.health.last_error
    assert by_key(source.samples())["meshscope_gpu_sm_active_ratio", 1, ""] == pytest.approx(0.25)


def test_an_exporter_that_never_answers_costs_one_timeout() -> None:
    def hang(_sock: socket.socket, released: threading.Event) -> None:
        released.wait(60)

    with serve(hang) as (url, released):
        source = DcgmSource(url=url, timeout_seconds=0.3)
        source.poll()
        returned_while_hanging = not released.is_set()
    assert returned_while_hanging
    assert not source.health.up
    assert "within 0.3 s" in (source.health.last_error or "")


def test_an_exporter_that_trickles_bytes_is_cut_at_the_deadline() -> None:
    def trickle(sock: socket.socket, released: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not released.wait(0.02):  # one byte every 20 ms: each recv alone would never time out
            sock.sendall(b"#")

    with serve(trickle) as (url, released):
        source = DcgmSource(url=url, timeout_seconds=0.3)
        source.poll()
        returned_while_trickling = not released.is_set()
    assert returned_while_trickling
    assert not source.health.up
    assert "within 0.3 s" in (source.health.last_error or "")


def test_junk_answer_is_counted_not_fatal() -> None:
    junk = bytes(range(256)) * 8 + b"\nnot a metric line\n{}\n"
    with serve(reply(junk)) as (url, _):
        source = DcgmSource(url=url, timeout_seconds=5.0)
        source.poll()
    assert not source.health.up  # nothing but junk: not an exporter's answer
    assert source.health.parse_errors_total >= 2
    assert "unreadable line" in (source.health.last_error or "")
    assert list(source.samples()) == []


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (reply(b"oops", head="HTTP/1.1 500 Internal Server Error\r\n"), "HTTP 500"),
        (reply(b"x" * 5000), "larger than 4096 bytes"),
        (lambda sock, _r: sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nshort"), "cut short"),
        (lambda sock, _r: sock.sendall(b"SSH-2.0-OpenSSH\r\n\r\n"), "not an HTTP answer"),
    ],
    ids=["500", "too-large", "cut-short", "not-http"],
)
def test_failed_scrapes_clear_gauges_and_keep_counters(answer: Callable[..., None], message: str) -> None:
    source = DcgmSource(timeout_seconds=5.0, max_bytes=4096)
    source.ingest(read("dcgm46_h200_2gpu.prom"))
    with serve(answer) as (url, _):
        source.url = url
        source.poll()
    assert not source.health.up
    assert message in (source.health.last_error or "")
    assert {s.metric for s in source.samples()} == {"meshscope_gpu_xid_errors_total"}


def test_refused_connection_and_bad_urls() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = DcgmSource(url=f"http://127.0.0.1:{port}/metrics", timeout_seconds=1.0)
    source.poll()
    assert not source.health.up
    assert "cannot read" in (source.health.last_error or "")
    for url in ("https://127.0.0.1:9400/metrics", "http://127.0.0.1:notaport/metrics", "file:///etc/passwd"):
        with pytest.raises(DcgmScrapeError):
            fetch(url, timeout_seconds=1.0, max_bytes=100)


def test_bad_settings_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="timeout_seconds > 0"):
        DcgmSource(timeout_seconds=0)


# --- fuzzing from the grammar ------------------------------------------------------------------------------------

_FIELDS = ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_SM_UTIL_RATIO", "DCGM_FI_DEV_SM_CLOCK"]
names = st.one_of(st.sampled_from(_FIELDS), st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True))
label_names = st.one_of(
    st.sampled_from(["gpu", "UUID", "uuid", "hostname", "Hostname", "pod", "GPU_I_ID"]),
    st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True),
)
label_values = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
values = st.one_of(
    st.integers(min_value=0, max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
)


def escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_value(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


@st.composite
def sample_lines(draw: st.DrawFn) -> tuple[str, str, dict[str, str], float]:
    name = draw(names)
    labels = draw(st.dictionaries(label_names, label_values, max_size=6))
    value = draw(values)
    space = draw(st.sampled_from(["", " ", "\t"]))
    body = ("," + space).join(f'{k}{space}={space}"{escape(v)}"' for k, v in labels.items())
    trailing = draw(st.sampled_from(["", ","])) if labels else ""
    braces = f"{{{body}{trailing}}}" if labels or draw(st.booleans()) else ""
    stamp = draw(st.sampled_from(["", " 1715000000000", " -5"]))
    return f"{name}{braces} {render_value(value)}{stamp}", name, labels, float(value)


junk_lines = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\n"), max_size=40).map(lambda t: "0" + t)
comment_lines = st.one_of(
    st.from_regex(r"# HELP [a-zA-Z_]\w{0,10}( [^\n]{0,20})?", fullmatch=True),
    st.from_regex(r"# TYPE [a-zA-Z_]\w{0,10} (counter|gauge|untyped)", fullmatch=True),
    st.just(""),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(sample_lines(), junk_lines, comment_lines), max_size=30))
def test_fuzz_parser_round_trips_valid_lines_and_counts_junk(lines: list[object]) -> None:
    text = "\n".join(line[0] if isinstance(line, tuple) else line for line in lines)  # type: ignore[index]
    parsed = parse_exposition(text)
    expected = [line for line in lines if isinstance(line, tuple)]
    assert parsed.junk_lines == sum(1 for line in lines if isinstance(line, str) and line.startswith("0"))
    assert len(parsed.samples) == len(expected)
    for sample, (_line, name, labels, value) in zip(parsed.samples, expected, strict=True):
        assert sample.name == name
        assert dict(sample.labels) == labels
        assert (math.isnan(sample.value) and math.isnan(value)) or sample.value == value


@st.composite
def gpu_scrapes(draw: st.DrawFn) -> tuple[str, dict[int, int], int]:
    """A dcgm-like scrape: GPU_UTIL percent per GPU, with junk lines mixed in; returns text, util and junk count."""
    util = draw(st.dictionaries(st.integers(0, 15), st.integers(0, 100), max_size=8))
    lines = [f'DCGM_FI_DEV_GPU_UTIL{{gpu="{g}",UUID="GPU-{g}",Hostname="n1"}} {p}' for g, p in util.items()]
    junk = draw(st.lists(junk_lines, max_size=5))
    order = draw(st.permutations(lines + junk))
    return "\n".join(order), util, len(junk)


@settings(max_examples=200)
@given(gpu_scrapes())
def test_fuzz_source_reads_every_gpu_despite_junk(scrape: tuple[str, dict[int, int], int]) -> None:
    text, util, junk = scrape
    source = DcgmSource(hostname="n1")
    source.ingest(text)
    got = {s.gpu: s.value for s in source.samples() if s.metric == "meshscope_gpu_utilization_ratio"}
    assert got.keys() == util.keys()
    for gpu, percent in util.items():
        assert got[gpu] == pytest.approx(percent / 100)
    assert source.health.parse_errors_total == junk


@settings(max_examples=200)
@given(st.binary(max_size=300))
def test_fuzz_source_never_raises_on_bytes(data: bytes) -> None:
    source = DcgmSource()
    source.ingest(data.decode("utf-8", errors="replace"))
    parsed = parse_exposition(data.decode("utf-8", errors="replace"))
    assert source.health.up is (bool(parsed.samples) or parsed.junk_lines == 0)
    assert source.health.parse_errors_total == parsed.junk_lines + source.last_stats.bad_series


def test_label_blocks_are_read_once_and_the_memory_of_them_is_bounded() -> None:
    from meshscope_sidecar.sources import dcgm  # noqa: PLC0415 - the module's cache, by name

    line = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",note="a \\"quoted\\" value"} 42\n'
    first, again = parse_exposition(line).samples[0], parse_exposition(line).samples[0]
    assert dict(first.labels) == {"gpu": "0", "UUID": "GPU-a", "note": 'a "quoted" value'}
    assert again.labels is first.labels  # one block, read once
    with pytest.raises(TypeError):
        first.labels["gpu"] = "1"  # type: ignore[index] # shared between samples: read-only
    # A bad block stays bad when seen again, and is counted as junk both times.
    bad = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",gpu="1"} 1\n'
    assert (parse_exposition(bad).junk_lines, parse_exposition(bad).junk_lines) == (1, 1)
    # An exporter that writes a new block on every line never grows the cache past its bound, nor keeps long ones.
    churn = "".join(f'DCGM_FI_DEV_GPU_UTIL{{gpu="{i}"}} 1\n' for i in range(dcgm._LABELS_SEEN_MAX + 100))
    assert len(parse_exposition(churn).samples) == dcgm._LABELS_SEEN_MAX + 100
    assert len(dcgm._LABELS_SEEN) <= dcgm._LABELS_SEEN_MAX
    long_block = f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",pad="{"x" * dcgm._LABELS_SEEN_LONGEST}"}} 1\n'
    assert parse_exposition(long_block).samples[0].labels["pad"] == "x" * dcgm._LABELS_SEEN_LONGEST
    assert all(len(key) <= dcgm._LABELS_SEEN_LONGEST for key in dcgm._LABELS_SEEN)


def test_the_old_namespaces_lower_case_names_are_read() -> None:
    # dcgm-exporter's old namespace writes the field names in lower case: every series was an unknown field, and
    # the source reported no GPU while it said it was up.
    source = ingested("old_namespace_mig.prom")
    assert source.last_stats.unknown_fields == 0
    values = by_key(source.samples())
    assert values["meshscope_gpu_sm_clock_hertz", 0, "1"] == pytest.approx(1.41e9)
    assert values["meshscope_gpu_sm_clock_hertz", 1, ""] == pytest.approx(1.2e9)
    assert values["meshscope_gpu_engine_active_ratio", 0, "1"] == pytest.approx(0.75)
    assert values["meshscope_gpu_engine_active_ratio", 0, "2"] == 0
    assert values["meshscope_gpu_memory_used_bytes", 0, "1"] == 30000 * MIB
    devices = {(d.index, d.mig_instance): d for d in source.devices()}
    assert set(devices) == {(0, 1), (0, 2), (1, None)}
    assert (devices[0, 1].pod, devices[0, 1].namespace, devices[0, 1].mig_profile) == ("job-0", "ml", "3g.40gb")
    assert devices[1, None].uuid == "GPU-11111111-2222-3333-4444-555555555551"


def test_an_exporter_that_names_its_pod_as_its_host_is_read_as_this_nodes() -> None:
    # In a pod of its own, dcgm-exporter's Hostname label is its pod's name: filtered by the node's name, every
    # series was dropped as another node's, and the sidecar said nothing.
    source = ingested("exporter_pod_hostname.prom", hostname="gpu-node-1")
    values = by_key(source.samples())
    assert values["meshscope_gpu_temperature_celsius", 1, ""] == 43
    assert values["meshscope_gpu_power_watts", 0, ""] == pytest.approx(512.25)
    assert source.last_stats.other_node == 0
    assert source.notes()[0].startswith(
        "dcgm-exporter names its host 'nvidia-dcgm-exporter-5e5b02', not this node 'gpu-node-1'"
    )
    # a host name given to filter by is kept to
    strict = ingested("exporter_pod_hostname.prom", hostname="gpu-node-1", one_host_is_this_node=False)
    assert [s for s in strict.samples() if s.metric != "meshscope_gpu_xid_errors_total"] == []
    assert strict.last_stats.other_node == 4
    assert strict.health.last_error is not None
    assert strict.health.last_error.startswith(
        "every series names another host (nvidia-dcgm-exporter-5e5b02), none this node 'gpu-node-1'"
    )


def test_a_scrape_of_another_nodes_exporter_is_dropped_and_said() -> None:
    # One host that is a node's name, not this one: a Service balanced the scrape to another node's exporter.
    source = ingested("dcgm46_h200_2gpu.prom", hostname="h200-node-3")
    assert source.last_stats.other_node == 30
    assert source.health.last_error is not None
    assert "the scrape reached another node's exporter" in source.health.last_error
