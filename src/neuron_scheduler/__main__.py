from neuron_scheduler.cli import main

main()
