"""Offline oracles: exact placement (MILP / exhaustive), autoscaling cost (Table 2 DP), per-window ρ̂
(Tables 8–10), and the heuristic-vs-oracle placement gap (Fig. 9 right)."""
