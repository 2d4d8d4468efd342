"""What one step of staleness costs a bench model's convergence: window means of 10 steps of the training loss on
the bench's 8-batch pool, synchronous vs every gradient one step stale (w_{t+1} = U(w_t, g_{t-1})). One process,
rank 0's pool, the preset's own optimizer. Usage: python benchmarks/results/stale-loss/stale_loss.py MODEL STEPS"""
import sys, copy, statistics, torch
from deft_compile.tools.bench_models import resolve_model
torch.set_num_threads(1)
name = sys.argv[1]; steps = int(sys.argv[2])
preset = resolve_model(name)
torch.manual_seed(0)
base = preset.build()
pool = [preset.batch(preset.default_batch, torch.Generator().manual_seed(10_000 + i)) for i in range(8)]
for mode in ("sync", "stale"):
    model = copy.deepcopy(base); opt = preset.optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    prev = None; losses = []
    for t in range(steps):
        (args, kwargs) = pool[t % 8]
        x, y = args
        loss = preset.loss_fn(model(x), y)
        opt.zero_grad(); loss.backward()
        if mode == "stale":
            cur = [p.grad.detach().clone() for p in params]
            if prev is None:
                for p in params: p.grad = None
                opt.step()
            else:
                for p, g in zip(params, prev): p.grad = g
                opt.step()
            prev = cur
        else:
            opt.step()
        losses.append(loss.item())
    windows = [round(statistics.mean(losses[i:i + 10]), 3) for i in range(0, steps, 10)]
    print(name, mode, windows, flush=True)
