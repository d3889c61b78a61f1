"""What launch makes of runs once they have run: statistics over seeds, comparisons of cells,
reports and charts, and the judgement of a sweep and of a recipe's recorded results.

It reads run directories (launch.runs) and uses the launching side (a sweep's grid, plan and
members, the reruns of recorded results); nothing on that side imports it. Only the command
line (launch.cli) sits above it: `make lint` holds the order ("launch layers")."""
