from specdec.experiment.run import main

main()
