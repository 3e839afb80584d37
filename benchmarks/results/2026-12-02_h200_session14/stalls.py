import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
# find header row
hi = next(i for i, r in enumerate(rows) if any("Sampling" in c for c in r))
h = rows[hi]; data = [r for r in rows[hi + 1:] if len(r) == len(h)]
print("columns:", h[:40])
ci = next(i for i, c in enumerate(h) if "Warp Stall Sampling (All" in c)
si = next(i for i, c in enumerate(h) if c.strip().lower() == "source")
def num(s):
    try: return float(s.replace(",", ""))
    except Exception: return 0.0
tot = sum(num(r[ci]) for r in data)
print("total samples", tot)
top = sorted(data, key=lambda r: -num(r[ci]))[:45]
for r in top:
    print(f"{num(r[ci]) / tot * 100:5.1f}% {r[0][:8]} {r[si][:110]}")
# by opcode
agg = {}
for r in data:
    op = r[si].strip().split(" ")[0] if r[si].strip() else "?"
    if op.startswith("@"):
        op = r[si].strip().split(" ")[1]
    agg[op.split(".")[0]] = agg.get(op.split(".")[0], 0) + num(r[ci])
print("by opcode:", sorted(((round(v / tot * 100, 1), k) for k, v in agg.items()), reverse=True)[:20])
