import torch,time,os,collections as co
from transformers import Qwen2Config as Q,LlamaConfig as L,AutoModelForCausalLM as A
from torch.profiler import profile,ProfilerActivity as P
O=os.environ['OUT'];D='cuda'
def l(h,i,n,kv,nh):return L(vocab_size=128256,hidden_size=h,intermediate_size=i,num_hidden_layers=n,num_attention_heads=nh,num_key_value_heads=kv,head_dim=h//nh,tie_word_embeddings=True,rope_theta=5e5)
C=[('q05',Q(vocab_size=151936,hidden_size=896,intermediate_size=4864,num_hidden_layers=24,num_attention_heads=14,num_key_value_heads=2,tie_word_embeddings=True,rope_theta=1e6),1,0,4,2048),('l1b',l(2048,8192,16,8,32),0,1,4,2048),('l3b',l(3072,8192,28,8,24),0,0,2,4096)]
S=torch.cuda.synchronize
for nm,cf,amp,ck,b,s in C:
 with torch.device(D):m=A.from_config(cf,attn_implementation='sdpa',dtype=torch.float32 if amp else torch.bfloat16)
 if ck:m.gradient_checkpointing_enable({'use_reentrant':False})
 m.train();o=torch.optim.AdamW(m.parameters(),fused=True);x=torch.zeros(b,s,dtype=torch.long,device=D)
 def st():
  with torch.autocast(D,torch.bfloat16,enabled=bool(amp)):q=m(input_ids=x,labels=x).loss
  q.backward();o.step();o.zero_grad(set_to_none=True)
 T=[]
 for i in range(7):
  S();t=time.perf_counter();st();S();T.append(time.perf_counter()-t)
 with profile(activities=[P.CPU,P.CUDA]) as p:st();S()
 K=sorted((e.time_range.start,e.time_range.end,e.name) for e in p.events() if e.device_type.name=='CUDA')
 bz=0;e0=-1
 for a,z,_ in K:
  if z>e0:bz+=z-max(a,e0);e0=z
 g=co.defaultdict(lambda:[0,0])
 for a,z,n in K:g[n][0]+=z-a;g[n][1]+=1
 r=sorted(g.items(),key=lambda kv:-kv[1][0])
 w=sorted(T[2:])[2]
 h=f'{nm} wall {w*1e3:.1f}ms busy {bz/1e3:.1f}ms sum {sum(v[0] for _,v in r)/1e3:.1f}ms n {len(K)}'
 print(h)
 with open(f'{O}/{nm}.txt','w') as f:
  f.write(h+'\n')
  for n,(u,c) in r[:150]:f.write(f'{u/1e3:9.3f} {c:5d} {n[:160]}\n')
 for n,(u,c) in r[:14]:print(f'{u/1e3:8.2f} {c:5d} {n[:90]}')
 del m,o,p;torch.cuda.empty_cache()
