"""Print a problem's finalists from a tuner journal: GPU time, eager, graph, host, config; then the chosen row."""
import json, sqlite3, sys
path, needle = sys.argv[1], sys.argv[2]
con = sqlite3.connect(path)
rows = con.execute("select problem_key, config, status, time_us, eager_us, graph_us, extra from measurements "
                   "where problem_key like ? order by time_us", (f"%{needle}%",)).fetchall()
print(len(rows), "rows")
for r in rows[:12]:
    ex = json.loads(r[6])
    print(f"{r[3]:8.2f} eager {r[4]} graph {r[5]} host {ex.get('host_us')} {r[2]} {r[1][:220]}")
print("finalists:")
for r in rows:
    if r[4] is not None:
        ex = json.loads(r[6])
        print(f"{r[3]:8.2f} eager {r[4]:.2f} graph {r[5]} host {ex.get('host_us')} {r[1][:220]}")
