"""Holding captured contexts for pulls: the byte-bounded store, who may pull, and the holder role
(announcements, grants, heart-beats) that senders and receivers share."""
