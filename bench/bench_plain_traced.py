"""Does turning traced verify passes on slow plain decoding? (GPU; issue 19, open question)

On an H100 on 2026-11-24 (b248771-57392b5) plain decoding of the 8B 4-bit trunk ran at
130-146 tok/s in processes with traced passes on and 157-170 tok/s with them off, on machines
of one kind; the plain path does not call the traced function, so this measures it in one
process: plain decoding (4 runs) A before tracing is on, B with it on, C after traced MTP
rounds, D with it off again, E after untraced rounds.

    python bench/bench_plain_traced.py     # on the GPU machine, ~2 minutes
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx.core as mx  # noqa: E402
from bench_gpu import RATES, Oracle, llama8b  # noqa: E402

from mtpkit.decoder.model.rows import use_kernel_linears  # noqa: E402
from mtpkit.decoder.model.trunk import Trunk  # noqa: E402
from mtpkit.decoder.runner import Runner  # noqa: E402
from mtpkit.decoder.tuning.costs import measure  # noqa: E402

runner = Runner(Trunk(llama8b(4)), None, None)
use_kernel_linears(runner.trunk.text)
vocab = runner.trunk.args.vocab_size
prompt = [(13 * i + 7) % vocab for i in range(128)]


def plain(label):
    tps = [runner.generate(prompt, 256, depth=0).stats.decode_tps for _ in range(4)]
    print(label, [round(t, 1) for t in tps], round(statistics.median(tps), 1), flush=True)
    return runner.generate(prompt, 256, depth=0).tokens


ref = plain("A fresh, untraced")
runner.trunk.use_traced()
plain("B traced on, no traced pass yet")
oracle = Oracle(prompt + ref, vocab, RATES, seed=0)
mtp = Runner(runner.trunk, oracle, None)
mtp._costs = measure(mtp)
for d in (3, 3, "auto"):
    r = mtp.generate(prompt, 256, depth=d)
    print("mtp", d, round(r.stats.decode_tps, 1), r.tokens == ref, flush=True)
plain("C after traced rounds")
runner.trunk.use_traced(False)
mx.clear_cache()
plain("D traced off again")
for d in (3,):
    r = mtp.generate(prompt, 256, depth=d)
    print("mtp untraced", d, round(r.stats.decode_tps, 1), flush=True)
plain("E after untraced rounds")
