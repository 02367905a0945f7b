import json,sys
d=json.load(open(sys.argv[1]))
for b in d['benchmarks']:
  print(b['name'])
  rows=sorted([(v,k[13:-1]) for k,v in b.items() if k.startswith('tokens_per_s[')], reverse=True)
  for v,k in rows: print(f'   {k:18s} {v:7.2f} {b["over_first["+k+"]"]:.3f}')
