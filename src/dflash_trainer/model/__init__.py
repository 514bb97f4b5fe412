"""The DFlash drafter: architecture, attention masks, anchors, losses."""
