import sys, torch
sys.path.insert(0, ".devrun")
from int4_variants import launch
from floorline.engine.quant import Int4Weight
from floorline.engine.kernels.gemv import SplitPartials
from floorline.engine.tuning import random_like
dev = torch.device("cuda"); gen = torch.Generator(device=dev).manual_seed(1)
n, k = 18944, 3584
proto = Int4Weight(torch.zeros(n // 4, k // 8 * 4, dtype=torch.int32, device=dev),
                   torch.zeros(n // 4, k // 128 * 4, dtype=torch.float16, device=dev),
                   torch.zeros(n // 4, k // 128 * 4, dtype=torch.uint8, device=dev), 128)
mats = [(random_like(proto, gen), random_like(proto, gen)) for _ in range(6)]
x = torch.randn(k, device=dev); norm = torch.randn(k, device=dev, dtype=torch.bfloat16)
out = torch.zeros(n, device=dev, dtype=torch.bfloat16); p = SplitPartials()
mode = int(sys.argv[1])
for m, u in mats:
    launch(x, m, u, out, norm, p, 8, 4, 1, 2, 1, mode, 0, 1, None, False, 0)
torch.cuda.synchronize()
