import numpy as np, torch, lossspec, torchloss, sys
rng=np.random.default_rng(0)
N,V=6,37
x=(rng.standard_normal((N,V))*8).astype(np.float32); t=(rng.standard_normal((N,V))*8).astype(np.float32)
y=rng.integers(0,V,N)
impls = sys.argv[1:] or ["torch"]
for impl in impls:
  for k in lossspec.ALL_KINDS:
    tgt = y if k=='cross_entropy' else (None if k=='entropy' else t)
    kw={'logit_softcap':10.0}
    if k in lossspec.DISTILL_KINDS: kw['teacher_logit_softcap']=5.0
    if k=='cross_entropy': kw['label_smoothing']=0.1
    l,g=lossspec.oracle(k,x,tgt,**kw)
    fn=getattr(torchloss,k)
    xt=torch.tensor(x,requires_grad=True)
    args=(xt,) + (() if tgt is None else (torch.tensor(tgt),))
    lt=fn(*args,impl=impl,**kw); lt.backward()
    print(impl,k,abs(float(lt)-l), np.abs(xt.grad.numpy()-g).max()/np.abs(g).max())
