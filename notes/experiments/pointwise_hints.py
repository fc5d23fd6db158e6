"""Notes v36: edits kernels/common.cuh of the tree in the working directory (never main's) for one
variant of the pointwise writing passes' memory hints: `cs` stores the gradients evict-first
(st.global.cs), `l2` loads input and target of the passes that write by 256-byte L2 blocks
(ld.global.nc.L2::256B), `csl2` both. The sum-only forward keeps plain loads."""
import sys
variant = sys.argv[1]
path = "kernels/common.cuh"
s = open(path).read()
edits = []
if "cs" in variant:
    edits += [("if (ptr.grad_input != nullptr) store_pack<T, VEC>(", "if (ptr.grad_input != nullptr) store_pack_streaming<T, VEC>("),
              ("if (ptr.grad_target != nullptr) store_pack<T, VEC>(", "if (ptr.grad_target != nullptr) store_pack_streaming<T, VEC>(")]
if "l2" in variant:
    edits += [("  v.input = load_pack<T, VEC>(ptr.input + offset);\n  v.target = load_pack<T, VEC>(ptr.target + offset);",
               "  v.input = kSumOnly ? load_pack<T, VEC>(ptr.input + offset) : load_pack_l2_block<T, VEC>(ptr.input + offset);\n"
               "  v.target = kSumOnly ? load_pack<T, VEC>(ptr.target + offset) : load_pack_l2_block<T, VEC>(ptr.target + offset);")]
for old, new in edits:
    assert s.count(old) == 1, old
    s = s.replace(old, new)
open(path, "w").write(s)
print(variant, len(edits), "edits")
