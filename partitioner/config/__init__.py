"""What the user asks for, typed: training settings and job files, the cluster and its device kinds.

settings.py         TrainingSettings, Request, Decisions: what the user asks and what compile chose
job.py              training settings: defaults < job file < training= / flags, checked
cluster.py          ClusterSpec: devices, nodes, links, cluster files
device_link_specs.py  DeviceSpec, LinkSpec: one device, one link, checked; each kind's default links
device_presets.py   device kinds: memory, FLOP/s per dtype, usable memory, cpu fixed costs
"""
