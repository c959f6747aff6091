"""kubelet's pod resources API: generated stubs per version (v1/, from proto/ by proto/generate.py).
`deviceplugin.holdings` is the one reader."""
