"""bench/long_context.py runs (issue 67; issue 68 asks every bench a quick mode the suite runs): under a memory cap
on the CPU, the tiled MLP reaches a longer sequence than SDPA alone, each answer's traced peak stays under the cap
(the script exits 1 otherwise), and the advisor's LoRA row on one H100 reaches ALST's 500K."""

import re


def test_the_long_context_bench_runs_quick(bench_script, capsys):
    bench = bench_script("long_context")
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    seqs = {m[0].strip(): int(m[1].replace(",", "")) for m in re.findall(r"^(.{48}) +([\d,]+) ", out, re.M)}
    plain, tiled = seqs["SDPA, packed documents (no mask)"], seqs["+ tiled MLP"]
    assert 0 < plain < tiled
    lora = re.search(r"^Llama-3.1-8B +1xH100-80GB +lora +([\d,]+)", out, re.M)
    assert int(lora[1].replace(",", "")) >= 500_000
