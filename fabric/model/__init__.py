"""Model definition and checkpoint loading shared by AWs (attention side) and EWs (expert side)."""
