"""The operators' outputs, saved for a bit-for-bit comparison of two builds
(the same kernels must give the same bits): forward and deterministic
backward of every backend of `device` and auto, fp32/fp16/bf16/fp64, a few
canonical workloads, and ms_deform_attn_fused with its four gradients.

    python scripts/bitwise_outputs.py save TREE OUT.pt [--device cuda] [--workloads a,b]  # TREE: a built checkout
    python scripts/bitwise_outputs.py compare A.pt B.pt                   # exit 1 if any differ
"""
import argparse
import sys

WORKLOADS = ["ddetr_dec", "rtdetr_dec", "ddetr_enc/4", "ddetr_enc@smooth/4", "bevformer_tsa/8"]


def save(tree, path, device, workloads):
    sys.path.insert(0, tree)
    import torch

    import ms_deform_attn as msda
    from ms_deform_attn import testing as W

    print("ms_deform_attn from", msda.__file__)
    res = {}
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
              "fp64": torch.float64}
    backends = [b for b in msda.available_backends(device) if b != "pytorch"]
    for name in workloads:
        wl = W.get(name)
        for dn, dt in dtypes.items():
            for be in backends + ["auto"]:
                inp = W.make_inputs(wl, dt, device=device, seed=1, requires_grad=True)
                try:
                    out = msda.ms_deform_attn(*inp, backend=be, deterministic=True)
                except RuntimeError:  # the backend refuses these inputs (its predicate)
                    continue
                torch.manual_seed(3)
                out.backward(torch.randn_like(out))
                key = f"{name}/{dn}/{be}"
                res[key + "/out"] = out.detach().cpu()
                for i in (0, 3, 4):
                    res[key + f"/grad{i}"] = inp[i].grad.cpu()
            torch.manual_seed(2)
            n, lq, m, lv, p = wl.n, wl.queries, wl.m, len(wl.levels), wl.p
            value, shapes, start = W.make_inputs(wl, dt, device=device, seed=1)[:3]
            value.requires_grad_(True)
            ref = torch.rand(n, lq, lv, 2, device=device, dtype=dt, requires_grad=True)
            off = (torch.randn(n, lq, m, lv, p, 2, device=device) * 3).to(dt).requires_grad_(True)
            logits = torch.randn(n, lq, m, lv * p, device=device, dtype=dt, requires_grad=True)
            out = msda.ms_deform_attn_fused(value, shapes, start, ref, off, logits, deterministic=True)
            out.backward(torch.randn_like(out))
            key = f"{name}/{dn}/fused"
            res[key + "/out"] = out.detach().cpu()
            for t_name, t in (("value", value), ("ref", ref), ("off", off), ("logits", logits)):
                res[key + "/grad_" + t_name] = t.grad.cpu()
    torch.save(res, path)
    print(f"saved {len(res)} tensors to {path}")


def compare(a_path, b_path):
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    common = [k for k in a if k in b]
    differ = [k for k in common if not torch.equal(a[k], b[k])]
    alone = sorted(set(a) ^ set(b))
    print(f"bitwise: {len(common) - len(differ)} tensors identical, {len(differ)} differ, "
          f"{len(alone)} in one file only {alone[:5]}")
    for k in differ[:20]:
        print("  differs:", k, (a[k].double() - b[k].double()).abs().max().item())
    return 1 if differ or alone else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("tree")
    s.add_argument("out")
    s.add_argument("--device", default="cuda")
    s.add_argument("--workloads", default=",".join(WORKLOADS))
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "save":
        save(args.tree, args.out, args.device, args.workloads.split(","))
    else:
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
