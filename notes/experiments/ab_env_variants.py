"""Forward or training-step GPU time (ms, median of 30 per round) of ours under environment
switches that an experiment's host code reads at every launch (main has none), so one build
and one process time every variant, interleaved round by round (notes v34, v35; the switches:
ce_stage_parts_switches.patch, h200_launch_switches.patch).
  AB_CASES="8192:50257:bfloat16:train mse:8192:8192:bfloat16:train ..." \
  AB_VARIANTS="base= parts4=CE_STAGE_PARTS=4 ..." python3 notes/experiments/ab_env_variants.py
A case is [loss:]rows:cols:dtype:fwd|train (loss ce, kl or mse; ce when left out). A variant is
name=VAR=value,VAR=value (none: the switches unset). Prints one JSON line."""
import json, os, statistics, sys, torch
sys.path.insert(0, ".")
import bench
SWITCHES = ("CE_STAGE_PARTS", "CE_PARTS_BY_WARPS", "CE_PREFETCH_KB", "CE_CLAIM_BLOCK_ROWS", "CE_PIPE_MIN_CLUSTER",
            "CE_PIPE_MAX_STAGES", "CE_CLAIMED_KB", "CE_CLAIMED_PER_WARP", "CE_ROW_BLOCKS_PER_SM", "PW_BLOCKS_PER_SM",
            "PW_TRAIN_PACKS_PER_THREAD", "PW_CONTIGUOUS_BATCHES")
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
for spec in os.environ["AB_CASES"].split():
    fields = spec.split(":")
    loss = fields.pop(0) if len(fields) == 5 else "ce"
    rows, cols, dt, mode = fields
    fn = bench.loss_fn_for("ours", loss)
    sets = bench.make_input_sets(loss, int(rows), int(cols), getattr(torch, dt))
    if mode == "train":
        for s in sets:
            s[0].requires_grad_(True)
    times = {name: [] for name in variants}
    first = [t.detach() for t in sets[0][:2]]
    # float64 truth: the inputs in float64 (CE's class indices as they are) through eager's formula
    ref = bench.EAGER[loss](*(t.double() if t.is_floating_point() else t for t in first)).item()
    for name, env in variants.items():  # each variant's loss, the same bits 20 times, against float64
        use(env)
        with torch.no_grad():
            losses_seen = {fn(*first).float().item() for _ in range(20)}
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
