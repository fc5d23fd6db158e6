"""Forward or training-step GPU time (ms, median of 30 per round) of ours for CE cases under
environment switches that an experiment's host code reads at every launch (main has none), so
one build and one process time every variant, interleaved round by round (notes v34; the
switches: ce_stage_parts_switches.patch and the variants v34 describes).
  AB_CASES="8192:50257:bfloat16:train ..." AB_VARIANTS="base= parts4=CE_STAGE_PARTS=4 ..." \
      python3 notes/experiments/ab_env_variants.py
A variant is name=VAR=value,VAR=value (none: the switches unset). Prints one JSON line."""
import json, os, statistics, sys, torch
sys.path.insert(0, ".")
import bench
SWITCHES = ("CE_STAGE_PARTS", "CE_PARTS_BY_WARPS", "CE_PREFETCH_KB", "CE_CLAIM_BLOCK_ROWS")
variants = {}
for spec in os.environ.get("AB_VARIANTS", "base=").split():
    name, _, sets = spec.partition("=")
    variants[name] = dict(kv.split("=") for kv in sets.split(",") if kv)
rounds = int(os.environ.get("AB_ROUNDS", "2"))


def use(env):
    """The switches of one variant, the others unset."""
    for key in SWITCHES:
        os.environ.pop(key, None)
    os.environ.update(env)


out = {}
fn = bench.loss_fn_for("ours", "ce")
for spec in os.environ["AB_CASES"].split():
    rows, cols, dt, mode = spec.split(":")
    sets = bench.make_input_sets("ce", int(rows), int(cols), getattr(torch, dt))
    if mode == "train":
        for s in sets:
            s[0].requires_grad_(True)
    times = {name: [] for name in variants}
    x, t = sets[0][:2]
    for name, env in variants.items():  # each variant's loss, the same bits 20 times, against float64
        use(env)
        with torch.no_grad():
            losses_seen = {fn(x, t).float().item() for _ in range(20)}
        ref = torch.nn.functional.cross_entropy(x.detach().double(), t).item()
        times[name + " loss"] = [f"{len(losses_seen)} value(s), error {max(abs(v - ref) for v in losses_seen):.1e}"]
    for _ in range(rounds):
        for name, env in variants.items():
            use(env)
            if mode == "train":
                ms = bench.training_step_times(fn, sets, 30, 5, True)
            else:
                ms = bench.forward_times(fn, sets, 30, 5, True)
            times[name].append(round(statistics.median(ms), 5))
    out[spec] = times
    print(spec, json.dumps(times), flush=True)
    del sets
    bench.free_gpu_memory()
print(json.dumps(out), flush=True)
