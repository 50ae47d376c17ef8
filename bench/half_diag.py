"""Half tiles: whole-tile routing (uniform 512 rows/expert: no half tile ever taken) vs topk8, FC1/FC2, interleaved."""
import sys
sys.argv=[sys.argv[0]]
from sm90_megamoe.launch import get_grouped_gemm
from sm90_megamoe.grouped_gemm_runner import bench
for n,k,act,sr in ((1536,2048,"swiglu",False),(2048,768,"identity",True)):
    fns={h:get_grouped_gemm(act,n,k,128,scale_rows=sr,half_tiles=h) for h in (False,True)}
    for r in range(2):
        for routing in ("uniform","topk8"):
            for h in (False,True):
                print(f"[diag] half_tiles={h} routing={routing} round {r}", flush=True)
                bench(fns[h],65536,n,k,128,act,routing,sr,iters=30)
